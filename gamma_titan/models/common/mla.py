"""Multi-head latent attention (MLA, DeepSeek-V2) with the optional output gate.

Queries come from the input directly (q_lora_rank = 0) or through a low-rank latent
(wq_a -> RMSNorm -> wq_b). Keys and values share one compressed latent of width
kv_lora_rank (wkv_a -> RMSNorm -> wkv_b); a small extra slice of wkv_a carries the rotary
part of the key, shared by all heads. Per head the query/key width is
qk_nope_head_dim + qk_rope_head_dim and the value width v_head_dim, so the gate (as in
GatedAttention) has one channel per value channel: W_g is d -> n_heads·v_head_dim
(elementwise) or d -> n_heads (headwise). Each low-rank projection is its own linear
layer, so the γ rule gives it the std of its own d_in.

On CUDA the values are zero-padded to the q/k head dim for SDPA and the output sliced
back (models/common/sdpa.py), so attention gets a fused kernel (flash needs equal head
dims); elsewhere SDPA sees the unpadded tensors.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

from .attention import ATTENTION_GATES
from .rope import apply_rope
from .sdpa import attend


class GatedMLA(nn.Module):
    GAMMA_GROUPS = {"": "attention", "gate_proj.": "gate"}  # (models/common/decoder.py, declared_init_rule)

    def __init__(self, dim: int, n_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 gate: str, norm_eps: float):
        super().__init__()
        if gate not in ATTENTION_GATES:
            raise ValueError(f"attention gate must be one of {ATTENTION_GATES}, got {gate!r}")
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.gate = gate
        if q_lora_rank == 0:
            self.wq = nn.Linear(dim, n_heads * self.qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        if gate != "none":
            self.gate_width = v_head_dim if gate == "elementwise" else 1
            self.gate_proj = nn.Linear(dim, n_heads * self.gate_width, bias=False)
        self.sdpa = ScaledDotProductAttentionWrapper()
        # Pad the head dims to one for SDPA: None decides per call from the tensors'
        # device (CUDA pads); tests force True to take the CUDA path on the CPU.
        self.pad_head_dims: bool | None = None
        # Set by the tensor-parallel plan: every rank holds a slice of the heads, but the
        # rotary key is shared by all heads, so its gradient must be summed over ranks.
        self.tp_mesh = None

    def _shared_by_all_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Identity forward; under TP, all-reduce the gradient in backward (each rank
        only sees its own heads' part of it)."""
        if self.tp_mesh is None:
            return t
        return DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()]
        )

    def qkv(self, x: torch.Tensor, rope: torch.Tensor):
        """Queries and keys (qk_dim per head, rotary part rotated) and values (v_head_dim
        per head), each (bs, seqlen, heads, ·)."""
        bs, seqlen, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.qk_dim)  # -1: local heads under TP
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)

        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = self._shared_by_all_heads(apply_rope(k_rope.unsqueeze(2), rope))  # one for all heads
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return q, k, v

    def gate_values(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W_g) as (bs, seqlen, heads, 1 or v_head_dim)."""
        return torch.sigmoid(self.gate_proj(x)).view(*x.shape[:2], -1, self.gate_width)

    # What the diagnostics' probe asks of an attention module (diagnostics/probe.py).
    def probe_qk(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qkv(x, rope)[:2]

    probe_gate = gate_values

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = self.qkv(x, rope)
        out = attend(self.sdpa, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     pad=self.pad_head_dims).transpose(1, 2)  # (bs, seqlen, heads, v_head_dim)
        if self.gate != "none":
            out = out * self.gate_values(x)
        return self.wo(out.reshape(bs, seqlen, -1))
