"""gamma_dense: a decoder-only, pre-norm Transformer with the paper's three knobs.

    h_0 = e = Embed(tokens)
    h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}))          (optionally gated per head)
    h_l = h_l     + SwiGLU(RMSNorm(h_l))
    logits = Output(RMSNorm(h_L))

RMSNorm, SwiGLU, RoPE, optional grouped-query attention; no biases, no dropout, untied
embeddings. Every RMSNorm uses `norm_eps` ([gamma] norm_eps); every weight is drawn by
the γ rule (gamma_titan/init.py) in `init_weights`.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from gamma_titan.init import gamma_init_, standard_fan_in
from gamma_titan.models.common import GatedAttention, SwiGLU, rope_cache

from .args import DenseModelArgs


class TransformerBlock(nn.Module):
    def __init__(self, args: DenseModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GatedAttention(
            args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attention_gate
        )
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = SwiGLU(args.dim, args.ffn_hidden_dim)

    def forward(self, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class GammaDense(ModelProtocol):
    def __init__(self, args: DenseModelArgs):
        super().__init__(args)
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", self._rope_cache(), persistent=False)

    def _rope_cache(self, device=None) -> torch.Tensor:
        a = self.model_args
        return rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, device=device)

    def forward(self, tokens: torch.Tensor, attention_masks: None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        rope = self.rope[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None) -> None:
        """Causal SDPA needs no mask object (TorchTitan's validator asks for one)."""
        return None

    # --- initialisation -------------------------------------------------------------

    @staticmethod
    def param_group(name: str) -> str:
        """The [gamma.init_rate_overrides] group a weight belongs to."""
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
    def init_rule(cls, name: str, shape: tuple[int, ...]) -> tuple[str, int | None]:
        fan_in = standard_fan_in(shape)
        return ("norm" if fan_in is None else cls.param_group(name)), fan_in

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Called by TorchTitan after the model is materialised (and sharded)."""
        device = buffer_device or self.rope.device
        self.rope = self._rope_cache(device=device)
        gamma_init_(self, self.model_args.init, self.init_rule)
