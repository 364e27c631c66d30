"""Checkpoint conversion between TorchTitan DCP checkpoints and Hugging Face folders."""
