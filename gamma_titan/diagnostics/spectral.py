"""Weight structure (paper §2.6, §4.7): stable rank and row-wise cosine similarity.

    stable rank  sr(W) = ‖W‖_F² / ‖W‖_2²          (between 1 and rank(W))
    row cosine   C_ij  = <w_i, w_j> / (‖w_i‖ ‖w_j‖)  for rows w_i of W

Under small initialisation the paper sees weights *condense*: stable rank falls early in
training (rows align, C fills with ±1 blocks), then rises again. ‖W‖_2 comes from power
iteration on WᵀW, warm-started from the previous call's vector, never from a full SVD.

A 3-D weight is a stack of experts (E, d_out, d_in); it gets one stable rank per expert,
in one batched iteration.

Sharded weights (FSDP, TP and EP DTensors): each rank multiplies its own block of W into
full-length vectors and the vectors are summed over the mesh, so only vectors (d_out or
d_in long, per expert) and scalars cross ranks, never a matrix. All weights on one mesh
iterate together: two all-reduces per iteration for all of them. The one exception is a strided shard (FSDP over TP on the
same dimension), which is first regathered along the FSDP dimension only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

#: Power iteration stops when σ changes by less than this (relative), or after the limit.
TOLERANCE = 1e-6
COLD_ITERS = 300
WARM_ITERS = 100


class _Block:
    """Where this rank's shard of a weight sits in the whole, as a batch of matrices
    (n, d_out, d_in), and how to sum a full-size tensor over the ranks that share it."""

    def __init__(self, weight: torch.Tensor):
        self.mesh = None
        if isinstance(weight, DTensor):
            if any(isinstance(p, _StridedShard) for p in weight.placements):
                weight = weight.redistribute(placements=[
                    Replicate() if isinstance(p, _StridedShard) else p for p in weight.placements])
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            mesh, placements = weight.device_mesh, weight.placements
            shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
            self.mesh = mesh
            self.index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            # A block held by several ranks (Replicate) counts once: on its first holder.
            self.owner = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(placements) if p.is_replicate())
            local = weight.to_local()
        else:
            self.index = tuple(slice(0, s) for s in weight.shape)
            self.owner = True
            local = weight
        self.shape = tuple(weight.shape)
        self.local = local.detach().float()
        if self.local.ndim == 2:  # one matrix: a batch of one
            self.local = self.local.unsqueeze(0)
            self.index = (slice(0, 1), *self.index)
            self.shape = (1, *self.shape)

    @property
    def mesh_key(self) -> tuple:
        """Blocks with equal keys sum over the same process groups and can share collectives."""
        if self.mesh is None:
            return ()
        return tuple(tuple(dist.get_process_group_ranks(self.mesh.get_group(d))) for d in range(self.mesh.ndim))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over every rank of the weight's mesh (each entry comes from one owner)."""
        if self.mesh is not None:
            for dim in range(self.mesh.ndim):
                dist.all_reduce(t, group=self.mesh.get_group(dim))
        return t

    def local_matvec(self, v: torch.Tensor) -> torch.Tensor:
        """This rank's part of W v, for full vectors v (n, d_in): (n, d_out), zeros elsewhere."""
        if self.mesh is None:  # the whole weight
            return torch.bmm(self.local, v.unsqueeze(-1)).squeeze(-1)
        e, r, c = self.index
        out = torch.zeros(self.shape[0], self.shape[1], device=self.local.device)
        if self.owner:
            out[e, r] = torch.bmm(self.local, v[e, c].unsqueeze(-1)).squeeze(-1)
        return out

    def local_rmatvec(self, u: torch.Tensor) -> torch.Tensor:
        """This rank's part of Wᵀ u, for full vectors u (n, d_out): (n, d_in)."""
        if self.mesh is None:
            return torch.bmm(self.local.transpose(1, 2), u.unsqueeze(-1)).squeeze(-1)
        e, r, c = self.index
        out = torch.zeros(self.shape[0], self.shape[2], device=self.local.device)
        if self.owner:
            out[e, c] = torch.bmm(self.local.transpose(1, 2), u[e, r].unsqueeze(-1)).squeeze(-1)
        return out

def _summed(blocks: list[_Block], parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each block's partial tensor over the (shared) mesh in one collective per mesh dim."""
    if blocks[0].mesh is None:
        return parts
    flat = blocks[0].sum(torch.cat([p.reshape(-1) for p in parts]))
    return [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in parts]), parts)]


class Spectral(NamedTuple):
    sigma: torch.Tensor       # ‖W‖_2: a scalar, or (E,) for a stack
    vector: torch.Tensor      # its right singular vector: (d_in,) or (E, d_in)
    iterations: int


def _power_iterations(blocks: list[_Block], starts: list[torch.Tensor | None],
                      tol: float = TOLERANCE, max_iters: int | None = None) -> list[Spectral]:
    """Power iteration on WᵀW for several weights on one mesh at once: every iteration
    sums all their partial products in two collectives. A weight stops iterating once its
    σ changes by less than `tol` (relative); the decision is made on summed, identical
    values, so every rank stops alike."""
    vs, sigmas = [], []
    for block, start in zip(blocks, starts):
        n, d_in = block.shape[0], block.shape[2]
        if start is None:  # a fixed seed: every rank starts alike
            v = torch.randn(n, d_in, generator=torch.Generator().manual_seed(0))
        else:
            v = start.reshape(n, d_in).float()
        v = v.to(block.local.device)
        vs.append(v / v.norm(dim=1, keepdim=True))
        sigmas.append(torch.zeros(n, device=block.local.device))
    limit = max_iters or (COLD_ITERS if any(s is None for s in starts) else WARM_ITERS)
    iterations = [0] * len(blocks)
    active = list(range(len(blocks)))
    for _ in range(limit):
        if not active:
            break
        us = _summed([blocks[i] for i in active], [blocks[i].local_matvec(vs[i]) for i in active])
        zs = _summed([blocks[i] for i in active], [blocks[i].local_rmatvec(u) for i, u in zip(active, us)])
        still = []
        for i, u, z in zip(active, us, zs):
            new_sigma = u.norm(dim=1)
            vs[i] = z / z.norm(dim=1, keepdim=True).clamp_min(1e-30)
            iterations[i] += 1
            if not bool(((new_sigma - sigmas[i]).abs() <= tol * new_sigma).all()):
                still.append(i)
            sigmas[i] = new_sigma
        active = still
    final = _summed(blocks, [b.local_matvec(v) for b, v in zip(blocks, vs)])
    return [Spectral(u.norm(dim=1), v, k) for u, v, k in zip(final, vs, iterations)]


def spectral_norm(weight: torch.Tensor, start: torch.Tensor | None = None,
                  tol: float = TOLERANCE, max_iters: int | None = None) -> Spectral:
    """‖W‖_2 of W (d_out, d_in), or per expert of a stack (E, d_out, d_in), by power
    iteration on WᵀW. `start` is the vector of an earlier call (warm start)."""
    [result] = _power_iterations([_Block(weight)], [start], tol, max_iters)
    if weight.ndim == 2:
        return Spectral(result.sigma[0], result.vector[0], result.iterations)
    return result


class StableRanks:
    """Stable ranks of named weights, remembering each one's singular vector between
    calls (warm start: a few iterations per call once training has settled)."""

    def __init__(self) -> None:
        self.vectors: dict[str, torch.Tensor] = {}
        self.iterations: dict[str, int] = {}  # of the last call, per weight

    def __call__(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        return self.all({name: weight})[name]

    def all(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stable ranks of many weights (a scalar each; (E,) for an expert stack). Weights
        on the same mesh iterate together. Every rank must pass the same names."""
        blocks = {name: _Block(w) for name, w in weights.items()}
        by_mesh: dict[tuple, list[str]] = {}
        for name, block in blocks.items():
            by_mesh.setdefault(block.mesh_key, []).append(name)
        out = {}
        for key in by_mesh:  # in parameter order, the same on every rank
            names = by_mesh[key]
            # Unsharded weights go one at a time (a matrix stays in cache through its
            # iterations); sharded ones together (one collective per iteration for all).
            batches = [[n] for n in names] if key == () else [names]
            results = [r for batch in batches for r in _power_iterations(
                [blocks[n] for n in batch], [self.vectors.get(n) for n in batch])]
            norms = _summed([blocks[n] for n in names],
                            [_local_frobenius_sq(blocks[n]) for n in names])
            for name, result, fro in zip(names, results, norms):
                self.vectors[name], self.iterations[name] = result.vector, result.iterations
                ranks = fro / result.sigma.pow(2).clamp_min(1e-30)
                out[name] = ranks[0] if weights[name].ndim == 2 else ranks
        return out


def _local_frobenius_sq(block: _Block) -> torch.Tensor:
    out = torch.zeros(block.shape[0], device=block.local.device)
    if block.owner:
        out[block.index[0]] = block.local.pow(2).sum(dim=(1, 2))
    return out


def leading_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a 2-D weight as a plain tensor on every rank; a sharded weight
    sends only those rows (each rank contributes the part of them it holds)."""
    block = _Block(weight)
    n = min(n, block.shape[1])
    _, r, c = block.index
    rows = torch.zeros(n, block.shape[2], device=block.local.device)
    hi = min(r.stop, n)
    if block.owner and hi > r.start:
        rows[r.start:hi, c] = block.local[0, : hi - r.start]
    return block.sum(rows)


def row_cosine(rows: torch.Tensor) -> torch.Tensor:
    """C_ij = cos(w_i, w_j) for the given rows."""
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T
