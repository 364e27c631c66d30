"""Attention-sink score (paper §2.1, eq. 5): the average attention mass on the first token.

For head h and query i of a causal attention, the mass on key 0 is

    A_h[i, 0] = exp(s·q_i·k_0 − LSE_i),   LSE_i = log Σ_{j ≤ i} exp(s·q_i·k_j)

(s: the softmax scale). The sink score of a layer is A_h[i, 0] averaged over heads,
queries i ≥ 1 (query 0 sees only key 0, so its mass is always 1) and sequences. LSE is
computed exactly in fp32, a block of queries at a time, so the T×T attention matrix is
never held whole: memory is `chunk`×T per head and sequence, at most MAX_BLOCK values.

Under a mask other than the causal one (flex attention's `mask_mod`: TorchTitan's
block-causal mask keeps each document to itself), "the first token" is the first key a
query may see, its document's first token, and the queries that see only themselves (each
document's first) are left out as query 0 is: with one document per sequence this is the
causal score exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

CHUNK = 256
#: Cap on one block of scores (batch × heads × chunk × T fp32 values): 256 MiB.
MAX_BLOCK = 2**26

#: flex attention's mask_mod(b, h, q_idx, kv_idx) -> bool, True where the query sees the key.
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


def first_token_mass(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                     chunk: int = CHUNK, mask_mod: MaskMod | None = None) -> torch.Tensor:
    """Mean attention mass on each query's first visible key, over the queries that see
    more than one key, per sequence and head (causal: the mass on key 0 over queries
    1..T-1).

    q: (batch, heads, T, d); k: (batch, kv_heads, T, d), kv_heads dividing heads (grouped
    query attention: query head h reads key head h // (heads / kv_heads), as SDPA's
    `enable_gqa`). `mask_mod`: flex attention's, evaluated on broadcast index tensors (as
    TorchTitan's mask mods are written) with the head index 0: the masks here do not
    depend on the head, and under tensor parallelism the probe sees local heads only.
    Returns (batch, heads), fp32.
    """
    q, k = q.float(), k.float()
    bs, heads, t, d = q.shape
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask_mod = causal if mask_mod is None else mask_mod
    chunk = max(1, min(chunk, MAX_BLOCK // (bs * heads * t)))
    total = torch.zeros(bs, heads, device=q.device)
    counted = torch.zeros(bs, 1, device=q.device)
    positions = torch.arange(t, device=q.device)
    batch, head = torch.arange(bs, device=q.device).view(bs, 1, 1, 1), torch.zeros((), dtype=torch.long,
                                                                                      device=q.device)
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        seen = mask_mod(batch, head, positions[start:stop].view(1, 1, -1, 1), positions.view(1, 1, 1, -1))
        seen = seen.expand(bs, 1, stop - start, t)
        scores = torch.einsum("bhid,bhjd->bhij", q[:, :, start:stop], k) * scale
        scores.masked_fill_(~seen, float("-inf"))  # in place: one block of scores, not two
        lse = torch.logsumexp(scores, dim=-1)
        first = seen.int().argmax(dim=-1, keepdim=True).expand(bs, heads, stop - start, 1)
        asked = seen.sum(dim=-1) > 1  # (bs, 1, chunk): a query that sees only itself has mass 1
        mass = torch.exp(scores.gather(-1, first).squeeze(-1) - lse)
        total += torch.where(asked, mass, 0.0).sum(dim=-1)
        counted += asked.sum(dim=-1)
    return total / counted.clamp_min(1)
