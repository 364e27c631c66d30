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
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

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
    """Elements [start, stop) of the flattened fp32 tensor, from the chunks covering them.
    Chunks are independent, so they are drawn on torch.get_num_threads() threads."""
    if stop <= start:
        return torch.empty(0)
    first, last = start // CHUNK, (stop - 1) // CHUNK
    base = first * CHUNK
    out = torch.empty(min((last + 1) * CHUNK, numel) - base)

    def one(k: int) -> None:
        lo, hi = k * CHUNK, min((k + 1) * CHUNK, numel)
        draw_chunk(entry, seed, k, out[lo - base:hi - base], truncation)

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(one, range(first, last + 1)))
    return out[start - base:stop - base]


def draw(entry: ParamInit, shape, seed: int, truncation: float = 0.0) -> torch.Tensor:
    """The full fp32 tensor for one parameter, on the CPU."""
    if entry.std is None:
        return torch.ones(shape)
    numel = math.prod(shape)
    return draw_range(entry, numel, seed, 0, numel, truncation).view(shape)


def flat_range(shape, local_shape, offset) -> tuple[int, int] | None:
    """[start, stop) of the block `local_shape` at `offset` in the flattened `shape`, when
    the block is one range of it: the dims after the last cut one are whole and those
    before it have size 1. None otherwise (a column block, say)."""
    size = math.prod(local_shape)
    if size == 0:
        return 0, 0
    cut = [d for d, (s, g) in enumerate(zip(local_shape, shape)) if s != g]
    if cut and any(s != 1 for s in local_shape[:cut[-1]]):
        return None
    start = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offset))
    return start, start + size


def local_range(param: torch.Tensor) -> tuple[int, int] | None:
    """This rank's shard of `param` as a range of the flattened global tensor, or None."""
    if not isinstance(param, DTensor):
        return 0, param.numel()
    # compute_local_shape_and_global_offset does not place _StridedShard (FSDP over TP) right.
    if any(isinstance(p, _StridedShard) or not (p.is_shard() or p.is_replicate()) for p in param.placements):
        return None
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return flat_range(tuple(param.shape), local_shape, offset)


@torch.no_grad()
def fill_(param: torch.Tensor, entry: ParamInit, seed: int, truncation: float = 0.0) -> None:
    """Write this rank's shard of the parameter's values (drawn on the CPU, then moved)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if entry.std is None:
        local.fill_(1.0)
    elif (span := local_range(param)) is not None:
        local.copy_(draw_range(entry, param.numel(), seed, *span, truncation).view(local.shape))
    else:
        # Not one range: draw the whole tensor and cut it. src_data_rank=None: every rank
        # holds it already, so cut locally, no comms.
        full = draw(entry, param.shape, seed, truncation)
        local.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local())


@torch.no_grad()
def gamma_init_(module: nn.Module, cfg: GammaInit, rule: InitRule, prefix: str = "") -> list[ParamInit]:
    """Initialise every parameter of `module` by the γ rule; returns the plan used.

    `prefix` is the name of `module` inside the full model when only a part (one block)
    is initialised, so that it gets the values it would get in the full model.
    """
    seed = cfg.seed if cfg.seed is not None else torch.initial_seed()
    plan = init_plan(module, cfg, rule, prefix)
    for entry, param in zip(plan, module.parameters()):
        fill_(param, entry, seed, cfg.truncation)
    return plan
