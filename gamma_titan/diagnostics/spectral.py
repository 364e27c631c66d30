"""Weight structure (paper §2.6, §4.7): stable rank and row-wise cosine similarity.

    stable rank  sr(W) = ‖W‖_F² / ‖W‖_2²          (between 1 and rank(W))
    row cosine   C_ij  = <w_i, w_j> / (‖w_i‖ ‖w_j‖)  for rows w_i of W

Under small initialisation the paper sees weights *condense*: stable rank falls early in
training (rows align, C fills with ±1 blocks), then rises again. ‖W‖_2 comes from power
iteration on WᵀW, warm-started from the previous call's vector, never from a full SVD.

Sharded weights (FSDP, TP and EP DTensors) are multiplied as DTensors: each rank works on
its own shard and only vectors (length d_in or d_out) and scalars cross ranks, so no rank
gathers a matrix. A 3-D weight is a stack of experts (E, d_out, d_in); it gets one
stable rank per expert, in one batched iteration.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

#: Power iteration stops when σ changes by less than this (relative), or after the limit.
TOLERANCE = 1e-6
COLD_ITERS = 300
WARM_ITERS = 100


def _like(weight: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (the same on every rank) as an operand for `weight`: a replicated DTensor
    on the weight's mesh, or the tensor itself."""
    if isinstance(weight, DTensor):
        return distribute_tensor(local, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                 src_data_rank=None)
    return local


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Spectral(NamedTuple):
    sigma: torch.Tensor       # ‖W‖_2: a scalar, or (E,) for a stack
    vector: torch.Tensor      # its right singular vector: (d_in,) or (E, d_in)
    iterations: int


def spectral_norm(weight: torch.Tensor, start: torch.Tensor | None = None,
                  tol: float = TOLERANCE, max_iters: int | None = None) -> Spectral:
    """‖W‖_2 of W (d_out, d_in), or per expert of a stack (E, d_out, d_in), by power
    iteration on WᵀW. `start` is the vector of an earlier call (warm start); cold starts
    use a fixed seed, so every rank starts alike."""
    w = weight.detach().float()
    batched = w.ndim == 3
    if not batched:
        w = w.unsqueeze(0)
    n, d_in = w.shape[0], w.shape[-1]
    if start is None:
        gen = torch.Generator().manual_seed(0)
        v = torch.randn(n, d_in, 1, generator=gen)
        max_iters = max_iters or COLD_ITERS
    else:
        v = start.reshape(n, d_in, 1).float().cpu()
        max_iters = max_iters or WARM_ITERS
    v = _like(w, (v / v.norm(dim=1, keepdim=True)).to(w.device))
    sigma = torch.zeros(n, device=w.device)
    iterations = 0
    while iterations < max_iters:
        iterations += 1
        u = torch.bmm(w, v)                       # (n, d_out, 1), sharded like W's rows
        z = torch.bmm(w.transpose(1, 2), u)       # WᵀW v: partial sums, reduced to replicated
        new_sigma = _full(u.norm(dim=1).squeeze(-1))
        v = z / z.norm(dim=1, keepdim=True).clamp_min(1e-30)
        done = bool(((new_sigma - sigma).abs() <= tol * new_sigma).all())
        sigma = new_sigma
        if done:
            break
    v = _full(v).squeeze(-1)
    sigma = _full(torch.bmm(w, _like(w, v.unsqueeze(-1))).norm(dim=1).squeeze(-1))
    return Spectral(sigma, v, iterations) if batched else Spectral(sigma[0], v[0], iterations)


def frobenius_sq(weight: torch.Tensor) -> torch.Tensor:
    """‖W‖_F² (per expert for a stack)."""
    w = weight.detach().float()
    return _full(w.pow(2).sum(dim=(-2, -1)))


class StableRanks:
    """Stable ranks of named weights, remembering each one's singular vector between
    calls (warm start: a few iterations per call once training has settled)."""

    def __init__(self) -> None:
        self.vectors: dict[str, torch.Tensor] = {}
        self.iterations: dict[str, int] = {}  # of the last call, per weight

    def __call__(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        sigma, self.vectors[name], self.iterations[name] = spectral_norm(weight, self.vectors.get(name))
        return frobenius_sq(weight) / sigma.pow(2).clamp_min(1e-30)


def leading_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a 2-D weight as a plain tensor on every rank; a sharded weight
    sends only those rows (each rank contributes the part of them it holds)."""
    if not isinstance(weight, DTensor):
        return weight.detach()[:n].float()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = weight.device_mesh
    n = min(n, weight.shape[0])
    shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    rows = torch.zeros(n, weight.shape[1], device=weight.device)
    # A rank that holds a replica of a block adds it only on the first replica.
    first_replica = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(weight.placements)
                        if p.is_replicate())
    lo, hi = offset[0], min(offset[0] + shape[0], n)
    if first_replica and hi > lo:
        local = weight.to_local().detach().float()
        rows[lo:hi, offset[1]:offset[1] + shape[1]] = local[: hi - lo]
    for dim in range(mesh.ndim):  # sum over the whole mesh: each element comes from one rank
        torch.distributed.all_reduce(rows, group=mesh.get_group(dim))
    return rows


def row_cosine(rows: torch.Tensor) -> torch.Tensor:
    """C_ij = cos(w_i, w_j) for the given rows."""
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T
