"""gamma_moe: the decoder with fine-grained MoE feed-forward layers and MHA or MLA.

    h = h + Attn(RMSNorm(h))        GatedAttention (MHA/GQA) or GatedMLA, optionally gated
    h = h + FFN(RMSNorm(h))         SwiGLU in the first n_dense_layers, then MoE:
                                    shared experts + top-k of many small routed experts

Block attribute names follow TorchTitan's (`moe_enabled`, `moe`, `moe.router.gate`,
`moe.experts`, `moe.shared_experts`) so that its expert-parallel plans and its
auxiliary-loss-free load balancing apply unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from gamma_titan.models.common import GatedAttention, SwiGLU
from gamma_titan.models.common.decoder import DecoderLM
from gamma_titan.models.common.mla import GatedMLA
from gamma_titan.models.common.moe import MoELayer

from .args import MoEModelArgs


def build_attention(args: MoEModelArgs) -> nn.Module:
    if args.attention == "mla":
        return GatedMLA(args.dim, args.n_heads, args.q_lora_rank, args.kv_lora_rank,
                        args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim,
                        args.attention_gate, args.norm_eps)
    return GatedAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attention_gate)


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = build_attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoELayer(args.moe_args(), args.dim, args.moe_hidden_dim, args.aux_loss_coeff,
                                args.expert_kernel)
        else:
            self.feed_forward = SwiGLU(args.dim, args.ffn_hidden_dim)

    def forward(self, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), rope)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class GammaMoE(DecoderLM):
    def __init__(self, args: MoEModelArgs):
        blocks = [MoEBlock(i, args) for i in range(args.n_layers)]
        super().__init__(args, blocks, args.rope_dim)
