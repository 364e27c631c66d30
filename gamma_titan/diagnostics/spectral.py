"""Weight structure (paper §2.6, §4.7): stable rank and row-wise cosine similarity.

    stable rank  sr(W) = ‖W‖_F² / ‖W‖_2²          (between 1 and rank(W))
    row cosine   C_ij  = <w_i, w_j> / (‖w_i‖ ‖w_j‖)  for rows w_i of W

Under small initialisation the paper sees weights *condense*: stable rank falls early in
training (rows align, C fills with ±1 blocks), then rises again. ‖W‖_2 comes from power
iteration on WᵀW, warm-started from the previous call's vector, never from a full SVD.

A 3-D weight is a stack of experts (E, d_out, d_in); it gets one stable rank per expert,
in one batched iteration.

Cost. Power iteration runs a fixed number of steps, `COLD_ITERS` from a random start and
`WARM_ITERS` from the previous measurement's vector, so no step waits for the host: the
results stay on the device until the caller moves them all at once. On an accelerator,
weights of one shape (and one sharding) are stacked and multiplied by one bmm per product.

Memory. What a measurement allocates beyond the model stays below the largest single
weight (as stored): an fp32 weight, or an fp32 local shard of one, is used in place; a
stack of same-shape weights, or the fp32 copy of a bf16 one, is made only where it fits
in that budget together with the vectors of everything iterating at the same time (and
the singular vectors kept between calls); a weight whose fp32 copy alone would not fit is
converted a block of rows at a time. Stacking is for accelerators (one kernel launch per
product instead of one per weight); on the CPU each weight iterates alone, in cache.
Measured by the profiler on the debug model (tests/test_diagnostics.py): 3.5 MiB against a
4 MiB largest weight in fp32, 1.8 MiB against 2 MiB in bf16.

Sharded weights (FSDP, TP and EP DTensors, FSDP over TP's strided shards included): each
rank multiplies its own block of W into full-length vectors and the vectors are summed
over the mesh, so only vectors (d_out or d_in long, per expert) and scalars cross ranks,
never a matrix; no weight is regathered. Weights on one mesh iterate together, at two
all-reduces per step for all of them (more groups only where the memory budget splits
them).
FSDP=2, TP=2 and EP=2 runs agree with one process to rtol 1e-4 in the tests (8e-5 at most
measured), a 2×2 FSDP-over-TP mesh to 1e-5.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

#: Power-iteration steps per measurement from a random start (a weight's first measurement).
#: Gaussian weights (initialisation) are the slowest case, σ1 ≈ σ2: σ comes out 2e-4 below
#: the exact value at 768×768, 5e-4 at 50304×768 and 2e-5 at 2048×768; on a debug run's
#: step-1 weights at most 8e-4 (median 3e-8). Trained weights (a spectral gap) reach fp32
#: rounding (1e-7) within 50 steps.
COLD_ITERS = 300
#: Steps from the previous measurement's vector (every later measurement): the vector
#: carries the earlier steps. On a debug run measured every 100 steps (AdamW, lr 3e-3), σ
#: is within 1.1e-5 of exact at steps 100, 200 and 300 (10 steps: 9e-4; 5 steps: 2e-2).
WARM_ITERS = 20
_FP32 = 4  # bytes


class Spectral(NamedTuple):
    sigma: torch.Tensor       # ‖W‖_2: a scalar, or (E,) for a stack
    vector: torch.Tensor      # its right singular vector: (d_in,) or (E, d_in)
    iterations: int


# --- where a rank's block sits --------------------------------------------------------------


def _as_index(positions: torch.Tensor) -> slice | torch.Tensor:
    """Global positions (on the host) as a slice where they are consecutive, which they
    are for every layout but a strided shard alone on its tensor dimension."""
    n = positions.numel()
    if n == 0:
        return slice(0, 0)
    first, last = int(positions[0]), int(positions[-1])
    if last - first + 1 == n and (n == 1 or bool((positions.diff() == 1).all())):
        return slice(first, last + 1)
    return positions


def _split(placement, positions: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """How `placement` splits a dimension with these positions into `parts` pieces (the
    same chunking that distributes the DTensor's data)."""
    if isinstance(placement, _StridedShard):
        split = _StridedShard(0, split_factor=placement.split_factor)
    else:
        split = Shard(0)
    return split._split_tensor(positions, parts, with_padding=False)[0]


def _layout(weight: DTensor) -> tuple[list[torch.Tensor], list[int]]:
    """Per tensor dimension: the global positions of this rank's block, and an upper bound
    on the block's length that is the same on every rank. The placements are applied left
    to right, as `distribute_tensor` does, strided shards included."""
    mesh = weight.device_mesh
    coordinate = mesh.get_coordinate()
    positions = [torch.arange(s) for s in weight.shape]
    bound = list(weight.shape)
    for mesh_dim, placement in enumerate(weight.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        d = placement.dim % weight.ndim
        parts = mesh.size(mesh_dim)
        positions[d] = _split(placement, positions[d], parts)[coordinate[mesh_dim]]
        bound[d] = max(len(p) for p in _split(placement, torch.arange(bound[d]), parts))
    return positions, bound


class _Part:
    """One weight as this rank holds it: its local block as a batch of matrices (m, r, c)
    (a view, in the weight's own dtype), where that block sits in the whole (E, R, C), and
    the mesh its partial products are summed over."""

    def __init__(self, name: str, weight: torch.Tensor):
        self.name, self.matrix = name, weight.ndim == 2
        self.mesh, self.owner, self.placements = None, True, ()
        if isinstance(weight, DTensor):
            positions, bound = _layout(weight)
            local = weight.to_local().detach()
            if tuple(local.shape) != tuple(len(p) for p in positions):
                raise AssertionError(f"{name}: local block {tuple(local.shape)} does not match its "
                                     f"placements {weight.placements}")
            self.mesh, self.placements = weight.device_mesh, tuple(weight.placements)
            # A block held by several ranks (Replicate) counts once: on its first holder.
            self.owner = all(self.mesh.get_local_rank(d) == 0
                             for d, p in enumerate(weight.placements) if p.is_replicate())
            host_index = [_as_index(p) for p in positions]
        else:
            local = weight.detach()
            host_index, bound = [slice(0, s) for s in weight.shape], list(weight.shape)
        self.shape = tuple(weight.shape)
        if self.matrix:  # one matrix: a stack of one
            local, host_index, bound = local.unsqueeze(0), [slice(0, 1), *host_index], [1, *bound]
            self.shape = (1, *self.shape)
        self.local = local
        # Positions as slices, or index tensors (on the host, and on the weight's device)
        self.host_index = tuple(host_index)
        self.index = tuple(i if isinstance(i, slice) else i.to(local.device) for i in host_index)
        self.bound_bytes = bound[0] * bound[1] * bound[2] * _FP32  # its fp32 block, on any rank
        self.stored_bytes = weight.numel() * weight.element_size()

    @property
    def mesh_key(self) -> tuple:
        """Parts with equal keys sum over the same process groups and can share collectives."""
        if self.mesh is None:
            return ()
        return tuple(tuple(dist.get_process_group_ranks(self.mesh.get_group(d))) for d in range(self.mesh.ndim))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over every rank of the weight's mesh (each entry comes from one owner)."""
        if self.mesh is not None:
            for dim in range(self.mesh.ndim):
                dist.all_reduce(t, group=self.mesh.get_group(dim))
        return t


# --- same-shape weights as one batch ---------------------------------------------------------


def _vector_bytes(members: list[_Part]) -> int:
    """A generous bound on what a batch's vectors take while it iterates: its left and
    right vectors, a few times over (products, their sums, the next step's)."""
    e, r, c = members[0].shape
    return 8 * len(members) * e * (r + c) * _FP32


def _holding(members: list[_Part], avail: int) -> tuple[str, int]:
    """How a batch of these parts holds its fp32 matrices, and the bytes it takes while it
    iterates, vectors included (the same on every rank): "view" (one fp32 weight, used in
    place), "copy" (a stack, or the fp32 copy of a bf16 weight, within `avail`) or
    "blocks" (one weight whose fp32 copy would not fit: converted a block of rows at a
    time, at each product, two blocks within `avail`)."""
    first, vectors = members[0], _vector_bytes(members)
    if len(members) == 1 and first.local.dtype == torch.float32:
        return "view", vectors
    if len(members) * first.bound_bytes + vectors <= avail:
        return "copy", len(members) * first.bound_bytes + vectors
    return "blocks", avail


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, for matrix-vector products: the CPU's bmm is 10-20x slower than a loop
    of matmuls when the batch holds more than one matrix."""
    if a.device.type != "cpu" or a.shape[0] == 1:
        return torch.bmm(a, b)
    return torch.stack([x @ y for x, y in zip(a, b)])


class _Batch:
    """k parts of one shape and layout, iterated as one: their local blocks stacked into
    (k·m, r, c) fp32 matrices for one bmm per product. Vectors are full-size, (k, E, C) on
    the right and (k, E, R) on the left; the products are this rank's partial sums."""

    def __init__(self, parts: list[_Part], avail: int):
        self.parts, self.k = parts, len(parts)
        first = parts[0]
        self.mesh, self.owner, self.index, self.shape = first.mesh, first.owner, first.index, first.shape
        self.m, self.r, self.c = first.local.shape
        self.rows = None  # rows per converted block ("blocks")
        holding, _ = _holding(parts, avail)
        if holding == "copy":
            self.mats = torch.empty(self.k * self.m, self.r, self.c, device=first.local.device)
            for j, part in enumerate(parts):
                self.mats[j * self.m:(j + 1) * self.m].copy_(part.local)
        else:
            self.mats = first.local
            if holding == "blocks":  # two blocks are alive while the next one is made
                room = max(0, avail - _vector_bytes(parts))
                self.rows = max(1, room // (2 * self.m * self.c * _FP32))

    def _blocks(self):
        """(row slice, fp32 matrices) over the local rows: all at once, or converted a block of rows at a time."""
        if self.rows is None:
            yield slice(None), self.mats
        else:
            for start in range(0, self.r, self.rows):
                rows = slice(start, start + self.rows)
                yield rows, self.mats[:, rows].float()

    def _take(self, v: torch.Tensor, index) -> torch.Tensor:
        """This rank's entries of full vectors (k, E, X): (k·m, x)."""
        e, x = index
        return v[:, e][..., x].reshape(self.k * self.m, -1)

    def _place(self, y: torch.Tensor, size: int, index) -> torch.Tensor:
        """Local results (k·m, x) into zero full vectors (k, E, size)."""
        e, x = index
        y = y.view(self.k, self.m, -1)
        if not (isinstance(x, slice) and x == slice(0, size)):
            full = y.new_zeros(self.k, self.m, size)
            full[..., x] = y
            y = full
        if not (isinstance(e, slice) and e == slice(0, self.shape[0])):
            full = y.new_zeros(self.k, self.shape[0], size)
            full[:, e] = y
            y = full
        return y

    def _nothing(self, size: int) -> torch.Tensor:
        return torch.zeros(self.k, self.shape[0], size, device=self.mats.device)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """This rank's part of W v: (k, E, C) -> (k, E, R)."""
        e, r, c = self.index
        if not self.owner:
            return self._nothing(self.shape[1])
        x = self._take(v, (e, c)).unsqueeze(-1)
        if self.rows is None:
            y = _bmm(self.mats, x).squeeze(-1)
        else:
            y = torch.empty(self.k * self.m, self.r, device=v.device)
            for rows, block in self._blocks():
                y[:, rows] = _bmm(block, x).squeeze(-1)
        return self._place(y, self.shape[1], (e, r))

    def rmatvec(self, u: torch.Tensor) -> torch.Tensor:
        """This rank's part of Wᵀ u: (k, E, R) -> (k, E, C)."""
        e, r, c = self.index
        if not self.owner:
            return self._nothing(self.shape[2])
        x = self._take(u, (e, r)).unsqueeze(1)
        z = None
        for rows, block in self._blocks():
            part = _bmm(x[..., rows], block).squeeze(1)
            z = part if z is None else z + part
        return self._place(z, self.shape[2], (e, c))

    def frobenius_sq(self) -> torch.Tensor:
        """This rank's part of ‖W‖_F² per matrix: (k, E)."""
        e = self.index[0]
        if not self.owner:
            return self._nothing(1)[..., 0]
        total = None
        for _, block in self._blocks():
            # row norms, then their squares summed: no copy of W, and accurate (one
            # vector_norm over a whole large matrix is off by up to 5e-3 on the CPU)
            part = torch.linalg.vector_norm(block, dim=2).square().sum(dim=1)
            total = part if total is None else total + part
        return self._place(total.unsqueeze(-1), 1, (e, slice(0, 1)))[..., 0]


def _summed(parts: list[_Part], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum partial tensors over their (shared) mesh in one collective per mesh dim."""
    if not tensors or parts[0].mesh is None:
        return tensors
    flat = parts[0].sum(torch.cat([t.reshape(-1) for t in tensors]))
    return [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _random_start(batch: _Batch) -> torch.Tensor:
    """The same on every rank and for every part: a fixed seed per weight."""
    e, c = batch.shape[0], batch.shape[2]
    v = torch.randn(e, c, generator=torch.Generator().manual_seed(0)).to(batch.mats.device)
    return v.expand(batch.k, e, c).clone()


def _power_iterations(batches: list[_Batch], starts: list[torch.Tensor | None],
                      counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Power iteration on WᵀW for batches on one mesh at once, `counts[i]` steps for batch
    i, from `starts[i]` ((k, E, C), or None: a random start). Every step sums the partial
    products of all batches still iterating in two collectives; nothing is read back to
    the host. Returns per batch (σ (k, E), ‖W‖_F² (k, E), right vector (k, E, C))."""
    vs = []
    for batch, start in zip(batches, starts):
        v = _random_start(batch) if start is None else start.to(batch.mats.device, torch.float32)
        vs.append(v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    parts = [b.parts[0] for b in batches]
    for step in range(max(counts, default=0)):
        active = [i for i, n in enumerate(counts) if n > step]
        us = _summed([parts[i] for i in active], [batches[i].matvec(vs[i]) for i in active])
        zs = _summed([parts[i] for i in active], [batches[i].rmatvec(u) for i, u in zip(active, us)])
        for i, z in zip(active, zs):
            vs[i] = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    final = _summed(parts, [b.matvec(v) for b, v in zip(batches, vs)] + [b.frobenius_sq() for b in batches])
    us, norms = final[:len(batches)], final[len(batches):]
    return [(u.norm(dim=-1), fro, v) for u, fro, v in zip(us, norms, vs)]


def spectral_norm(weight: torch.Tensor, start: torch.Tensor | None = None,
                  iterations: int | None = None) -> Spectral:
    """‖W‖_2 of W (d_out, d_in), or per expert of a stack (E, d_out, d_in), by power
    iteration on WᵀW. `start` is the vector of an earlier call (warm start)."""
    ranks = StableRanks()
    if start is not None:
        ranks.vectors["w"] = start.reshape(-1 if weight.ndim == 3 else 1, weight.shape[-1])
    if iterations is not None:
        ranks.cold_iters = ranks.warm_iters = iterations
    ranks.all({"w": weight})
    sigma, vector = ranks.sigmas["w"], ranks.vectors["w"]
    if weight.ndim == 2:
        return Spectral(sigma[0], vector[0], ranks.iterations["w"])
    return Spectral(sigma, vector, ranks.iterations["w"])


class StableRanks:
    """Stable ranks of named weights, remembering each one's singular vector between
    calls (warm start: `warm_iters` steps per call instead of `cold_iters`)."""

    def __init__(self, cold_iters: int = COLD_ITERS, warm_iters: int = WARM_ITERS,
                 stack: bool | None = None) -> None:
        """`stack`: same-shape weights iterate as one stack (one bmm per product); None
        stacks on accelerators (fewer kernel launches) and not on the CPU, where a weight
        alone stays in cache through its steps and a stack would stream from memory."""
        self.cold_iters, self.warm_iters, self.stack = cold_iters, warm_iters, stack
        self.vectors: dict[str, torch.Tensor] = {}   # (1 or E, d_in) per weight
        self.sigmas: dict[str, torch.Tensor] = {}    # (1 or E,) per weight, of the last call
        self.iterations: dict[str, int] = {}         # of the last call, per weight

    def __call__(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        return self.all({name: weight})[name]

    def all(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stable ranks of many weights (a scalar each; (E,) for an expert stack), on the
        weights' device: nothing is read back to the host. Every rank must pass the same
        names, in the same order (the batches and collectives follow them)."""
        parts = [_Part(name, w) for name, w in weights.items()]
        if not parts:
            return {}
        budget = max(p.stored_bytes for p in parts)  # the largest single weight
        # less the singular vectors kept between calls (old and new, during the call):
        # what the batches iterating at once may take, copies and vectors
        avail = max(0, budget - 2 * sum(p.shape[0] * p.shape[2] for p in parts) * _FP32)
        # Same-shape, same-layout weights batch together; the key holds nothing that
        # differs between ranks, so every rank forms the same batches and collectives.
        groups: dict[tuple, list[_Part]] = {}
        for p in parts:
            warm = p.name in self.vectors
            key = (p.mesh_key, p.shape, p.local.dtype, p.placements, warm)
            groups.setdefault(key, []).append(p)
        by_mesh: dict[tuple, list[tuple[list[_Part], bool]]] = {}
        stack = self.stack if self.stack is not None else parts[0].local.device.type != "cpu"
        for key, members in groups.items():
            if not stack:
                per = 1
            else:
                per = max(1, avail // (members[0].bound_bytes + _vector_bytes(members[:1])))
            for i in range(0, len(members), per):
                chunk = members[i:i + per]
                by_mesh.setdefault(key[0], []).append((chunk, key[-1]))
        out: dict[str, torch.Tensor] = {}
        for mesh_key, entries in by_mesh.items():  # in parameter order, the same on every rank
            # Unsharded batches go one at a time (a batch stays in cache through its steps);
            # sharded ones together where the budget allows (two collectives per step for all).
            for wave in self._waves(entries, avail, together=mesh_key != ()):
                # The wave's batches (and their copies) are made here and freed before the next.
                self._measure([(_Batch(entries[i][0], avail), entries[i][1]) for i in wave], out)
        return {p.name: out[p.name] for p in parts}

    @staticmethod
    def _waves(entries: list[tuple[list[_Part], bool]], avail: int, together: bool) -> list[list[int]]:
        """Which batches iterate together: on a shared mesh, as many as fit in the budget
        together, copies and vectors (they share each step's collectives); otherwise one at
        a time."""
        if not together:
            groups = [[i] for i in range(len(entries))]
        else:
            groups, current, held = [], [], 0
            for i, (members, _) in enumerate(entries):
                holding, size = _holding(members, avail)
                alone = holding == "blocks"  # converts blocks at each product: the budget is its own
                if current and (alone or held + size > avail):
                    groups.append(current)
                    current, held = [], 0
                current.append(i)
                held += size
                if alone:
                    groups.append(current)
                    current, held = [], 0
            if current:
                groups.append(current)
        return groups

    def _measure(self, wave: list[tuple[_Batch, bool]], out: dict[str, torch.Tensor]) -> None:
        batches = [b for b, _ in wave]
        counts = [self.warm_iters if warm else self.cold_iters for _, warm in wave]
        starts = [torch.stack([self.vectors[p.name] for p in b.parts]) if warm else None for b, warm in wave]
        results = _power_iterations(batches, starts, counts)
        for batch, count, (sigma, fro, v) in zip(batches, counts, results):
            ranks = fro / sigma.square().clamp_min(1e-30)
            for j, part in enumerate(batch.parts):
                self.vectors[part.name] = v[j].clone()
                self.sigmas[part.name] = sigma[j]
                self.iterations[part.name] = count
                out[part.name] = ranks[j, 0] if part.matrix else ranks[j]


def leading_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of a 2-D weight as a plain fp32 tensor on every rank; a sharded
    weight sends only those rows (each rank contributes the part of them it holds)."""
    part = _Part("rows", weight)
    n = min(n, part.shape[1])
    _, r, _ = part.host_index
    c = part.index[2]
    local = part.local[0]
    rows = torch.zeros(n, part.shape[2], device=local.device)
    if part.owner:
        if isinstance(r, slice):
            keep = slice(0, max(0, min(r.stop, n) - r.start))
            targets = slice(r.start, r.start + keep.stop)
        else:  # positions on the host: no device sync
            keep = (r < n).nonzero().squeeze(-1)
            targets = r[keep]
        block = torch.zeros(local[keep].shape[0], part.shape[2], device=local.device)
        block[:, c] = local[keep].float()
        rows[targets] = block
    return part.sum(rows)


def row_cosine(rows: torch.Tensor) -> torch.Tensor:
    """C_ij = cos(w_i, w_j) for the given rows."""
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T
