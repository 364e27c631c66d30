"""The decoder skeleton every gamma_titan model shares.

    h_0 = e = Embed(tokens)
    h_l = block_l(h_{l-1}, rope)        (pre-norm attention + feed-forward, per family)
    logits = Output(RMSNorm(h_L))

Untied embeddings, no biases, no dropout. A family (dense, MoE) supplies its blocks and
says which γ group each of its parameters belongs to (`param_group`); initialisation is
the γ rule of gamma_titan/init.py for every parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from gamma_titan.init import gamma_init_, standard_fan_in

from .rope import rope_cache


class DecoderLM(ModelProtocol):
    def __init__(self, args, blocks: list[nn.Module], rope_dim: int):
        super().__init__(args)
        self.model_args = args
        self.rope_dim = rope_dim
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        a = self.model_args
        return rope_cache(self.rope_dim, a.max_seq_len, a.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor, attention_masks: None = None, *, head: bool = True) -> torch.Tensor:
        """Logits; with `head=False`, the final norm's output instead (for readers of the
        activations, such as the diagnostics' probe, which need no vocabulary matmul)."""
        h = self.tok_embeddings(tokens)
        rope = self.rope[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rope)
        h = self.norm(h)
        return self.output(h) if head else h

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None) -> None:
        """Causal SDPA needs no mask object (TorchTitan's validator asks for one)."""
        return None

    # --- initialisation -------------------------------------------------------------

    @staticmethod
    def param_group(name: str) -> str:
        """The [gamma.init_rate_overrides] group of a weight; families extend this."""
        if name.startswith("tok_embeddings."):
            return "embedding"
        if name.startswith("output."):
            return "output"
        if ".attention.gate_proj." in name:
            return "gate"
        if ".attention." in name:
            return "attention"
        if ".feed_forward." in name:
            return "ffn"
        raise KeyError(f"no γ group for parameter {name!r}")

    @classmethod
    def param_fan_in(cls, name: str, shape: tuple[int, ...]) -> int | None:
        return standard_fan_in(shape)

    @classmethod
    def init_rule(cls, name: str, shape: tuple[int, ...]) -> tuple[str, int | None]:
        fan_in = cls.param_fan_in(name, shape)
        return ("norm" if fan_in is None else cls.param_group(name)), fan_in

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Called by TorchTitan after the model is materialised (and sharded)."""
        device = buffer_device or self.rope.device
        self.rope = self._rope_cache(device=device)
        reset_buffers(self, device)
        gamma_init_(self, self.model_args.init, self.init_rule)


def reset_buffers(module: nn.Module, device) -> None:
    """Give every submodule with state buffers (MoE load counters, expert bias) its
    initial state; after `to_empty` they hold garbage."""
    for sub in module.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers(device)
