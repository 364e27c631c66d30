"""The paper's knobs on TorchTitan's own models: `[model] name = "llama3"` (or "qwen3",
"deepseek_v3") with a `[gamma]` table. llama3.py, qwen3.py and deepseek_v3.py are each one
of TorchTitan's families, registered under TorchTitan's name (so TorchTitan's trainer and
ours both build it); without [gamma] knobs each is TorchTitan's model bit for bit.
knobs.py holds what they share, moe.py TorchTitan's MoE layer on a CPU, hf.py the
Hugging Face names."""

from . import deepseek_v3, llama3, qwen3

__all__ = ["deepseek_v3", "llama3", "qwen3"]
