"""γ-initialisation: every weight matrix W ~ N(0, σ²) with σ = d_in^(−γ).

d_in ("fan-in") is the dimension the weight contracts with in the forward pass:
`in_features` for a linear layer, the model width for the token embedding (a lookup
row is a d-vector; the paper's derivation puts e ~ N(0, d^(−2γ))). RMSNorm scales
start at 1. γ = 0.5 is the standard (Xavier-like) scale, γ = 1 the paper's balance
point, γ > 1 starts the network close to the identity.

Values do not depend on the device, the FSDP/TP degree or the number of CPU threads:
each parameter's flattened tensor is drawn in chunks of CHUNK elements, chunk k from its
own CPU generator (numpy's PCG64) seeded by (seed, parameter name, k), and every rank
draws only the chunks that cover its own shard. CUDA's sampler lays its stream out by the GPU's SM
count, and DTensor's RNG tracker is not parallel-invariant on CPU, so neither is used.
"""

from __future__ import annotations

import hashlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

logger = logging.getLogger(__name__)

#: Parameter groups whose γ can be overridden one by one ([gamma.init_rate_overrides]).
GROUPS = ("embedding", "attention", "gate", "ffn", "router", "output")

#: Module names that wrappers (activation checkpointing, torch.compile, FSDP1) insert;
#: dropped so a parameter keeps the name it has in the bare model.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


@dataclass
class GammaInit:
    """The init part of `[gamma]` (see `gamma_titan.config.Gamma`)."""

    rate: float = 1.0
    rate_overrides: dict[str, float] = field(default_factory=dict)
    truncation: float = 0.0  # cut at ± truncation·σ; 0 = plain normal, as in the paper
    seed: int | None = None  # None: torch.initial_seed(), which TorchTitan syncs across ranks

    def rate_for(self, group: str) -> float:
        return self.rate_overrides.get(group, self.rate)


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is initialised."""

    name: str
    group: str  # one of GROUPS, or "norm"
    fan_in: int | None  # None for norm scales (filled with 1)
    gamma: float | None

    @property
    def std(self) -> float | None:
        """d_in^(−γ); None for a norm scale, or without γ (a model keeping its own init)."""
        return None if self.fan_in is None or self.gamma is None else self.fan_in**-self.gamma


def canonical_name(name: str) -> str:
    return ".".join(s for s in name.split(".") if s not in _WRAPPER_SEGMENTS)


def unwrapped(module):
    """The module that wrappers hold (torch.compile's OptimizedModule, an activation
    checkpoint's CheckpointWrapper, FSDP1's), however deep; the module itself where none.
    What looks at a module by type or attribute after parallelization (TorchTitan's
    apply_compile swaps a MoE's router for a compiled wrapper of it) looks through them."""
    while True:
        inner = next((getattr(module, attr) for attr in _WRAPPER_SEGMENTS
                      if isinstance(getattr(module, attr, None), torch.nn.Module)), None)
        if inner is None:
            return module
        module = inner


#: A model's rule: parameter name and global shape -> (group, fan_in).
InitRule = Callable[[str, tuple[int, ...]], tuple[str, "int | None"]]


def standard_fan_in(shape: tuple[int, ...]) -> int | None:
    """1-D tensors are norm scales (None). 2-D weights are stored (out, in) by nn.Linear
    and (vocab, width) by nn.Embedding, so the last dimension is d_in either way."""
    if len(shape) == 1:
        return None
    if len(shape) == 2:
        return shape[-1]
    raise ValueError(f"no standard fan-in for a {len(shape)}-D weight; the model must say")


def init_plan(module: nn.Module, cfg: GammaInit, rule: InitRule, prefix: str = "") -> list[ParamInit]:
    """One `ParamInit` per parameter of `module`, in `module.parameters()` order."""
    plan = []
    for name, param in module.named_parameters():
        name = prefix + canonical_name(name)
        group, fan_in = rule(name, tuple(param.shape))
        gamma = None if fan_in is None else cfg.rate_for(group)
        plan.append(ParamInit(name, group if fan_in is not None else "norm", fan_in, gamma))
    return plan


#: Elements per chunk of the flattened tensor. Part of the scheme: changing it changes
#: every weight drawn from more than one chunk.
CHUNK = 2**20


def param_seed(seed: int, name: str, chunk: int) -> int:
    """A stable 63-bit seed per (run seed, parameter name, chunk); independent of hash()."""
    digest = hashlib.blake2b(f"{seed}:{name}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def standard_normal(n: int, rng: np.random.Generator) -> torch.Tensor:
    """n float32 N(0, 1) values from numpy's ziggurat: integer arithmetic and lookup tables
    (libm only in the rare tails), the same code on every host. Not torch's CPU sampler:
    its float32 kernel is AVX2-only, so draws differ by an ulp between AVX2 hosts and
    AVX-512 or Arm ones, and its float64 path is about 2x slower than this."""
    return torch.from_numpy(rng.standard_normal(n, dtype=np.float32))


def draw_chunk(entry: ParamInit, seed: int, k: int, out: torch.Tensor, truncation: float = 0.0) -> None:
    """Chunk k into `out`: N(0, 1) from the chunk's own generator (with truncation, the
    values beyond ± truncation redrawn from it, in order, until none is), times σ."""
    rng = np.random.Generator(np.random.PCG64(param_seed(seed, entry.name, k)))
    z = standard_normal(out.numel(), rng)
    if truncation > 0:
        redo = (z.abs() > truncation).nonzero().squeeze(1)
        while redo.numel():
            z[redo] = standard_normal(redo.numel(), rng)
            redo = redo[z[redo].abs() > truncation]
    torch.mul(z, entry.std, out=out)


def draw_range(entry: ParamInit, numel: int, seed: int, start: int, stop: int,
               truncation: float = 0.0) -> torch.Tensor:
    """Elements [start, stop) of the flattened fp32 tensor, from the chunks covering them."""
    if stop <= start:
        return torch.empty(0)
    return draw_segments(entry, numel, seed, torch.tensor([start]), torch.tensor([stop - start]), truncation)[0]


def draw(entry: ParamInit, shape, seed: int, truncation: float = 0.0) -> torch.Tensor:
    """The full fp32 tensor for one parameter, on the CPU."""
    if entry.std is None:
        return torch.ones(shape)
    numel = math.prod(shape)
    return draw_range(entry, numel, seed, 0, numel, truncation).view(shape)


def local_block(param: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dimension, the global indices of this rank's block of `param` (None: all of
    them). DTensor's own cut of an index vector tells, so every placement FSDP, TP and EP
    make (strided shards too) reads the same; a mesh dimension of size 1 cuts nothing."""
    if not isinstance(param, DTensor):
        return [None] * param.ndim
    block = []
    for dim, size in enumerate(param.shape):
        placements = [p if _shards(p, dim) else Replicate() for p in param.placements]
        if all(p.is_replicate() for p in placements):
            block.append(None)
            continue
        index = torch.arange(size).view([size if d == dim else 1 for d in range(param.ndim)])
        local = distribute_tensor(index, param.device_mesh, placements, src_data_rank=None).to_local()
        block.append(None if local.numel() == size else local.flatten().cpu())
    return block


def _shards(placement, dim: int) -> bool:
    """Whether a placement cuts tensor dimension `dim` (a _StridedShard is no Shard in torch 2.13)."""
    return (placement.is_shard() or isinstance(placement, _StridedShard)) and placement.dim == dim


def block_segments(shape, block: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block as contiguous segments of the flattened tensor, in the block's own order:
    (starts, lengths). The dims after the last cut one are whole; along that one, runs of
    consecutive indices join into one segment."""
    shape = tuple(shape)
    cut = [d for d, index in enumerate(block) if index is not None]
    if not cut:
        return torch.tensor([0]), torch.tensor([math.prod(shape)])
    last = cut[-1]
    inner = math.prod(shape[last + 1:])
    index = block[last]
    if index.numel() == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1
    run_starts = torch.cat([torch.tensor([0]), breaks])
    run_lengths = torch.diff(torch.cat([run_starts, torch.tensor([index.numel()])]))
    starts = index[run_starts] * inner
    for d in range(last - 1, -1, -1):  # every combination of the outer dims' indices, in order
        outer = block[d] if block[d] is not None else torch.arange(shape[d])
        starts = (outer * math.prod(shape[d + 1:])).view(-1, 1) + starts.view(1, -1)
    lengths = (run_lengths * inner).repeat(starts.numel() // run_lengths.numel())
    return starts.flatten(), lengths


def covering_chunks(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The chunks that hold any value of these (non-empty) segments."""
    first, last = starts // CHUNK, (starts + lengths - 1) // CHUNK
    return torch.unique(torch.cat([torch.arange(a, b + 1) for a, b in
                                   torch.stack([first, last], 1).unique(dim=0).tolist()]))


def values_drawn(param: torch.Tensor) -> int:
    """How many values `fill_` draws on this rank for `param` (its covering chunks), without
    drawing them: what a layout costs at init (gamma_titan/estimate.py)."""
    if param.ndim < 2:  # norm scales: filled with 1
        return 0
    starts, lengths = block_segments(param.shape, local_block(param))
    keep = lengths > 0
    if not keep.any():
        return 0
    numel = param.numel()
    return sum(min(CHUNK, numel - k * CHUNK) for k in covering_chunks(starts[keep], lengths[keep]).tolist())


#: Seconds to draw one value on one CPU thread (numpy's ziggurat, measured on this project's
#: CPU machines: 12.4 ns; chunks are drawn on torch.get_num_threads() threads).
DRAW_SECONDS_PER_VALUE = 12.4e-9


def draw_segments(entry: ParamInit, numel: int, seed: int, starts: torch.Tensor, lengths: torch.Tensor,
                  truncation: float = 0.0) -> tuple[torch.Tensor, int]:
    """The values of these segments of the flattened tensor, one after another, and how many
    values were drawn for them: only the chunks that cover them, each once (on
    torch.get_num_threads() threads), held one at a time per thread, never the whole tensor."""
    out = torch.empty(int(lengths.sum()))
    if out.numel() == 0:
        return out, 0
    ends = starts + lengths
    offsets = torch.cumsum(lengths, 0) - lengths  # where each segment goes in `out`
    chunks = covering_chunks(starts, lengths)

    def one(k: int) -> int:
        lo, hi = k * CHUNK, min((k + 1) * CHUNK, numel)
        covered = torch.nonzero((starts < hi) & (ends > lo)).flatten().tolist()  # the segments it feeds
        if len(covered) == 1 and starts[covered[0]] <= lo and ends[covered[0]] >= hi:  # all of it: in place
            at = int(offsets[covered[0]]) + lo - int(starts[covered[0]])
            draw_chunk(entry, seed, k, out[at:at + hi - lo], truncation)
            return hi - lo
        values = torch.empty(hi - lo)
        draw_chunk(entry, seed, k, values, truncation)
        for s in covered:
            a, b = max(int(starts[s]), lo), min(int(ends[s]), hi)
            at = int(offsets[s]) + a - int(starts[s])
            out[at:at + b - a] = values[a - lo:b - lo]
        return hi - lo

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        drawn = sum(pool.map(one, chunks.tolist()))
    return out, drawn


@torch.no_grad()
def fill_(param: torch.Tensor, entry: ParamInit, seed: int, truncation: float = 0.0) -> int:
    """Write this rank's block of the parameter's values: the chunks that cover it are
    drawn on the CPU, and only the block moves to the parameter's device. Returns the
    values drawn."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if entry.std is None:
        local.fill_(1.0)
        return 0
    starts, lengths = block_segments(param.shape, local_block(param))
    values, drawn = draw_segments(entry, param.numel(), seed, starts, lengths, truncation)
    local.copy_(values.view(local.shape))
    return drawn


@torch.no_grad()
def gamma_init_(module: nn.Module, cfg: GammaInit, rule: InitRule, prefix: str = "") -> list[ParamInit]:
    """Initialise every parameter of `module` by the γ rule; returns the plan used.

    `prefix` is the name of `module` inside the full model when only a part (one block)
    is initialised, so that it gets the values it would get in the full model.
    """
    seed = cfg.seed if cfg.seed is not None else torch.initial_seed()
    plan = init_plan(module, cfg, rule, prefix)
    drawn = held = 0
    for entry, param in zip(plan, module.parameters()):
        drawn += fill_(param, entry, seed, cfg.truncation)
        held += (param.to_local() if isinstance(param, DTensor) else param).numel() if entry.std is not None else 0
    if any(isinstance(p, DTensor) for p in module.parameters()):
        logger.info(f"γ-init: this rank drew {drawn:,} values for the {held:,} of its shards "
                    f"(whole chunks of {CHUNK:,} that cover them)")
    return plan
