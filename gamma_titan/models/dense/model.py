"""gamma_dense: a decoder-only, pre-norm Transformer with the paper's three knobs.

    h = h + Attn(RMSNorm(h))       (optionally gated per head)
    h = h + SwiGLU(RMSNorm(h))

on the shared decoder skeleton (models/common/decoder.py): RMSNorm, SwiGLU, RoPE,
optional grouped-query attention, no biases, no dropout, untied embeddings. Every
RMSNorm uses `norm_eps` ([gamma] norm_eps); every weight is drawn by the γ rule.
"""

from __future__ import annotations

import torch
from torch import nn

from gamma_titan.models.common import GatedAttention, SwiGLU
from gamma_titan.models.common.decoder import DecoderLM

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


class GammaDense(DecoderLM):
    def __init__(self, args: DenseModelArgs):
        super().__init__(args, [TransformerBlock(args) for _ in range(args.n_layers)], args.head_dim)
