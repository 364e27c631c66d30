"""The family's args, flavors, block, model and Hugging Face adapter: all it has of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gamma_titan.models.common import GatedAttention, SwiGLU
from gamma_titan.models.common.decoder import DecoderLM
from gamma_titan.models.common.decoder_args import AttentionFFNArgs
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.hf_layout import GammaPackageAdapter

#: The block's sublayers, in the order the residual stream meets them.
SUBLAYERS = ("feed_forward_in", "attention", "feed_forward")


@dataclass
class SandwichBlockArgs(AttentionFFNArgs):
    ATTENTION = "attention"
    FFN = "feed_forward"

    def matmul_params(self) -> int:
        """AttentionFFNArgs counts one SwiGLU a block: this block has two."""
        return super().matmul_params() + self.n_layers * 3 * self.dim * self.ffn_hidden_dim


sandwich_flavors = Flavors({
    "debug": SandwichBlockArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=4096,
                               max_seq_len=256),
})


class SandwichBlock(nn.Module):
    def __init__(self, args: SandwichBlockArgs):
        super().__init__()
        self.feed_forward_in = SwiGLU(args.dim, args.ffn_hidden_dim)
        self.attention = GatedAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attention_gate)
        self.feed_forward = SwiGLU(args.dim, args.ffn_hidden_dim)
        self.norms = nn.ModuleDict({f"{side}_{sublayer}": nn.RMSNorm(args.dim, eps=args.norm_eps)
                                    for sublayer in SUBLAYERS for side in ("pre", "post")})

    def forward(self, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        n = self.norms
        h = h + n["post_feed_forward_in"](self.feed_forward_in(n["pre_feed_forward_in"](h)))
        h = h + n["post_attention"](self.attention(n["pre_attention"](h), rope))
        return h + n["post_feed_forward"](self.feed_forward(n["pre_feed_forward"](h)))


class SandwichBlockLM(DecoderLM):
    def __init__(self, args: SandwichBlockArgs):
        super().__init__(args, [SandwichBlock(args) for _ in range(args.n_layers)], args.head_dim)


class SandwichBlockStateDictAdapter(GammaPackageAdapter):
    ARGS = SandwichBlockArgs
    HF_CLASS = "SandwichBlockForCausalLM"
    HF_CODE = (Path(__file__).with_name("modeling_sandwich_block.py"),)
