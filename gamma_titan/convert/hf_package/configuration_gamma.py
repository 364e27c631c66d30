"""Configuration of gamma-titan models in Hugging Face form (written by `gamma-titan convert`)."""

from transformers import PretrainedConfig


class GammaConfig(PretrainedConfig):
    model_type = "gamma_titan"

    def __init__(self, vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=None, intermediate_size=704, rms_norm_eps=1e-12, rope_theta=10000.0,
                 max_position_embeddings=4096, attention_gate="elementwise", **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.attention_gate = attention_gate  # "none" | "headwise" | "elementwise"
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
