"""Attention-sink score (paper §2.1, eq. 5): the average attention mass on the first token.

For head h and query i of a causal attention, the mass on key 0 is

    A_h[i, 0] = exp(s·q_i·k_0 − LSE_i),   LSE_i = log Σ_{j ≤ i} exp(s·q_i·k_j)

(s: the softmax scale). The sink score of a layer is A_h[i, 0] averaged over heads,
queries i ≥ 1 (query 0 sees only key 0, so its mass is always 1) and sequences. LSE is
computed exactly in fp32, a block of queries at a time, so the T×T attention matrix is
never held whole: memory is `chunk`×T per head and sequence, at most MAX_BLOCK values.
"""

from __future__ import annotations

import math

import torch

CHUNK = 256
#: Cap on one block of scores (batch × heads × chunk × T fp32 values): 256 MiB.
MAX_BLOCK = 2**26


def first_token_mass(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                     chunk: int = CHUNK) -> torch.Tensor:
    """Mean attention mass on key 0 over queries 1..T-1, per sequence and head.

    q: (batch, heads, T, d); k: (batch, kv_heads, T, d), kv_heads dividing heads (grouped
    query attention: query head h reads key head h // (heads / kv_heads), as SDPA's
    `enable_gqa`). Returns (batch, heads), fp32.
    """
    q, k = q.float(), k.float()
    bs, heads, t, d = q.shape
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if t < 2:
        return torch.ones(bs, heads, device=q.device)
    chunk = max(1, min(chunk, MAX_BLOCK // (bs * heads * t)))
    total = torch.zeros(bs, heads, device=q.device)
    positions = torch.arange(t, device=q.device)
    for start in range(1, t, chunk):
        stop = min(start + chunk, t)
        scores = torch.einsum("bhid,bhjd->bhij", q[:, :, start:stop], k[:, :, :stop]) * scale
        causal = positions[:stop][None, :] <= positions[start:stop][:, None]
        scores.masked_fill_(~causal, float("-inf"))  # in place: one block of scores, not two
        lse = torch.logsumexp(scores, dim=-1)
        total += torch.exp(scores[..., 0] - lse).sum(dim=-1)
    return total / (t - 1)
