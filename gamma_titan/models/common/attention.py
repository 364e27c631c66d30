"""Causal multi-head attention with grouped KV heads and an optional output gate.

Gated attention (Qiu et al. 2025): each head's SDPA output is multiplied by
sigmoid(x W_g), where x is the block's normed input (the same x the queries see), before
the output projection. `headwise` learns one gate per head (W_g: d -> n_heads),
`elementwise` one per channel (W_g: d -> n_heads * head_dim). A gate that can close
lets a head output nothing without parking its attention on the first token, which is
what removes the attention sink that small initialisation makes worse. With
`gate = "none"` the module has no W_g and computes plain attention.
"""

import torch
from torch import nn
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

from .rope import apply_rope

ATTENTION_GATES = ("none", "headwise", "elementwise")


class GatedAttention(nn.Module):
    #: γ groups (models/common/decoder.py, declared_init_rule): the gate has its own
    GAMMA_GROUPS = {"": "attention", "gate_proj.": "gate"}

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, gate: str):
        super().__init__()
        if gate not in ATTENTION_GATES:
            raise ValueError(f"attention gate must be one of {ATTENTION_GATES}, got {gate!r}")
        self.head_dim = head_dim
        self.enable_gqa = n_kv_heads < n_heads
        self.gate = gate
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        if gate != "none":
            self.gate_width = head_dim if gate == "elementwise" else 1
            self.gate_proj = nn.Linear(dim, n_heads * self.gate_width, bias=False)
        # TorchTitan's SDPA module (causal; the module form is what context parallel hooks).
        self.sdpa = ScaledDotProductAttentionWrapper()

    def qkv(self, x: torch.Tensor, rope: torch.Tensor):
        """Queries, keys (rotated) and values, each (bs, seqlen, heads, head_dim)."""
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def gate_values(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W_g) as (bs, seqlen, heads, 1 or head_dim)."""
        return torch.sigmoid(self.gate_proj(x)).view(*x.shape[:2], -1, self.gate_width)

    # What the diagnostics' probe asks of an attention module (diagnostics/probe.py).
    def probe_qk(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qkv(x, rope)[:2]

    probe_gate = gate_values

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = self.qkv(x, rope)
        out = self.sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=self.enable_gqa
        ).transpose(1, 2)  # (bs, seqlen, heads, head_dim)
        if self.gate != "none":
            out = out * self.gate_values(x)
        return self.wo(out.reshape(bs, seqlen, -1))
