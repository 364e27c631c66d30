"""γ-initialisation: every weight matrix W ~ N(0, σ²) with σ = d_in^(−γ).

d_in ("fan-in") is the dimension the weight contracts with in the forward pass:
`in_features` for a linear layer, the model width for the token embedding (a lookup
row is a d-vector; the paper's derivation puts e ~ N(0, d^(−2γ))). RMSNorm scales
start at 1. γ = 0.5 is the standard (Xavier-like) scale, γ = 1 the paper's balance
point, γ > 1 starts the network close to the identity.

Each parameter is drawn *whole* from its own generator, seeded by (seed, parameter
name), and then cut to the local shard. That makes the full weights identical at any
FSDP/TP degree, on any device mesh, whatever order parameters are visited in; DTensor's
own RNG tracker does not give that on CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

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
        return None if self.fan_in is None else self.fan_in**-self.gamma


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


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (run seed, parameter name); independent of hash()."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw(entry: ParamInit, shape, seed: int, device, truncation: float = 0.0) -> torch.Tensor:
    """The full fp32 tensor for one parameter."""
    if entry.std is None:
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(param_seed(seed, entry.name))
    out = torch.empty(shape, device=device, dtype=torch.float32)
    if truncation > 0:
        bound = truncation * entry.std
        return nn.init.trunc_normal_(out, 0.0, entry.std, -bound, bound, generator=gen)
    return out.normal_(0.0, entry.std, generator=gen)


@torch.no_grad()
def fill_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's shard."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds `full` already, so cut locally, no comms.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def gamma_init_(module: nn.Module, cfg: GammaInit, rule: InitRule, prefix: str = "") -> list[ParamInit]:
    """Initialise every parameter of `module` by the γ rule; returns the plan used.

    `prefix` is the name of `module` inside the full model when only a part (one block)
    is initialised, so that it gets the values it would get in the full model.
    """
    seed = cfg.seed if cfg.seed is not None else torch.initial_seed()
    plan = init_plan(module, cfg, rule, prefix)
    for entry, param in zip(plan, module.parameters()):
        device = param.device if not isinstance(param, DTensor) else param.to_local().device
        full = draw(entry, param.shape, seed, device, cfg.truncation)
        fill_(param, full.to(param.dtype))
    return plan
