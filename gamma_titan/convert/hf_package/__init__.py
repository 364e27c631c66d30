"""Template files copied into converted folders for models no standard transformers class
represents exactly (the attention gate). They import only torch and transformers, so the
folder works anywhere with `trust_remote_code=True`."""
