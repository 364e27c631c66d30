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


@dataclass
class ParallelBlockArgs(AttentionFFNArgs):
    ATTENTION = "attention"
    FFN = "feed_forward"


parallel_flavors = Flavors({
    "debug": ParallelBlockArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, vocab_size=4096,
                               max_seq_len=256),
})


class ParallelBlock(nn.Module):
    def __init__(self, args: ParallelBlockArgs):
        super().__init__()
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GatedAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attention_gate)
        self.feed_forward = SwiGLU(args.dim, args.ffn_hidden_dim)

    def forward(self, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + self.attention(x, rope) + self.feed_forward(x)


class ParallelBlockLM(DecoderLM):
    def __init__(self, args: ParallelBlockArgs):
        super().__init__(args, [ParallelBlock(args) for _ in range(args.n_layers)], args.head_dim)


class ParallelBlockStateDictAdapter(GammaPackageAdapter):
    ARGS = ParallelBlockArgs
    HF_CLASS = "ParallelBlockForCausalLM"
    HF_CODE = (Path(__file__).with_name("modeling_parallel_block.py"),)
