"""The step guard ([gamma.reliability]): what a step's loss and gradient norm decide.

  * Non-finite guard: after backward, the global gradient norm (which TorchTitan
    computes for clipping, the same on every rank) is checked. A NaN/Inf step is skipped
    (no optimizer or LR-schedule step, logged as `nonfinite_skipped` in metrics.jsonl) or
    stops the run with `NonFiniteError` naming the step. A checkpoint is never written
    from parameters that are not finite.
  * Loss spikes: a step whose loss exceeds `loss_spike_factor` x the running mean of the
    last `loss_spike_window` steps is logged (`loss_spike` in that step's metrics.jsonl
    line) with the global batch it came from, so the offending data can be found.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger


class NonFiniteError(RuntimeError):
    """The run stops: a non-finite loss or gradient (or parameters about to be saved)."""


def parameters_finite(model_parts: list[torch.nn.Module], device) -> bool:
    """Whether every parameter on every rank is finite (a collective when distributed), in
    one host sync: the max-norms of this rank's shards in one fused reduction (a NaN or an
    Inf anywhere makes its tensor's max-norm NaN or Inf; a max cannot overflow)."""
    shards = [local for part in model_parts for p in part.parameters()
              if (local := p.to_local() if hasattr(p, "to_local") else p).numel()]
    bad = torch.zeros((), device=device)
    if shards:
        norms = torch._foreach_norm(shards, ord=float("inf"))
        bad = torch.stack(norms).isfinite().logical_not().any().to(device=device, dtype=bad.dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


class LossSpikes:
    """Running mean of the last `window` step losses; a loss above factor x mean is a spike."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, loss: float) -> float | None:
        """The running mean if `loss` is a spike against it, else None; then remember it."""
        spike = None
        if self.factor > 0 and len(self.recent) == self.recent.maxlen and math.isfinite(loss):
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                spike = mean
        if math.isfinite(loss):
            self.recent.append(loss)
        return spike


class StepGuard:
    """Decides, once per step and identically on every rank, whether the update happens."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.skipped = 0
        self.spikes = LossSpikes(cfg.loss_spike_factor, cfg.loss_spike_window)

    def check(self, step: int, grad_norm: float, loss: float) -> bool:
        """True: apply the update. False: skip it. Raises NonFiniteError to stop."""
        if math.isfinite(grad_norm) and math.isfinite(loss):
            return True
        what = f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm})"
        if self.cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"{what}; stopping (gamma.reliability.on_nonfinite = \"stop\"). "
                                 "The last checkpoint is intact.")
        self.skipped += 1
        if self.skipped > self.cfg.max_skipped_steps:
            raise NonFiniteError(f"{what}; {self.skipped} steps skipped in this run, more than "
                                 f"gamma.reliability.max_skipped_steps = {self.cfg.max_skipped_steps}: stopping")
        logger.warning(f"{what}; update skipped ({self.skipped} of at most {self.cfg.max_skipped_steps})")
        return False


class StepVerdict(NamedTuple):
    loss: float  # the step's global loss (the mean over every data-parallel rank's tokens)
    grad_norm: float  # the global gradient norm (0 when clipping did not compute one)
    stop: bool  # some rank got SIGTERM: every rank stops after this step


def step_verdict(loss: torch.Tensor, grad_norm: torch.Tensor | None, stop_requested: bool,
                 counts_loss: bool = True) -> StepVerdict:
    """What every rank must agree on before it applies a step's update, in one all-reduce
    over the world and one device-to-host copy (each `.item()` would be a host sync that
    stalls the GPU queue). `loss` is this rank's share of the global mean loss;
    `counts_loss` is False on all but one rank of each group holding the same loss
    (tensor-parallel peers). `grad_norm` is global already (clipping reduces it)."""
    if isinstance(loss, DTensor):  # under tensor parallelism (loss parallel): the same on every TP rank
        loss = loss.full_tensor()
    device = loss.device
    # torch.full fills on the device; torch.tensor(x, device=cuda) would copy from pageable
    # host memory, which waits for the queue (the backward) to drain
    votes = torch.stack([loss.detach().float() * (1.0 if counts_loss else 0.0),
                         torch.full((), 1.0 if stop_requested else 0.0, device=device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(votes)
    norm = grad_norm.detach().float().reshape(1) if grad_norm is not None else torch.zeros(1, device=device)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    total, stops, norm_value = torch.cat([votes, norm.to(device)]).tolist()
    return StepVerdict(total, norm_value, stops > 0)
