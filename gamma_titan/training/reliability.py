"""What keeps a long run alive and its state intact ([gamma.reliability]).

  * Non-finite guard: after backward, the global gradient norm (which TorchTitan
    computes for clipping, the same on every rank) is checked. A NaN/Inf step is skipped
    (no optimizer or LR-schedule step, logged as `nonfinite_skipped` in metrics.jsonl) or
    stops the run with `NonFiniteError` naming the step. A checkpoint is never written
    from parameters that are not finite.
  * Loss spikes: a step whose loss exceeds `loss_spike_factor` x the running mean of the
    last `loss_spike_window` steps is logged (`loss_spike` in that step's metrics.jsonl
    line) with the global batch it came from, so the offending data can be found.
  * Graceful stop: SIGTERM (what SLURM and torchrun send before a kill) makes every rank
    finish the step in progress, write a full checkpoint of it and exit 0. If that takes
    longer than `stop_grace_seconds`, the process exits with 143 and the last complete
    checkpoint stays the one to resume from.
  * Crash-safe checkpoints: a checkpoint folder counts only once its DCP `.metadata` is
    written (DCP writes it last). At start-up, incomplete folders are reported; keep-last-K
    counts and deletes only complete ones, so it never removes the only complete
    checkpoint (TorchTitan's own purge counts every step-N folder).
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
from collections import deque
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

STEP_FOLDER = re.compile(r"^step-(\d+)$")
#: What a non-finite step does (gamma.reliability.on_nonfinite): skip its update, or stop.
ON_NONFINITE = ("skip", "stop")


class NonFiniteError(RuntimeError):
    """The run stops: a non-finite loss or gradient (or parameters about to be saved)."""


# --- checkpoint folders ------------------------------------------------------------------


def checkpoint_steps(folder: str | os.PathLike) -> tuple[list[int], list[int]]:
    """(complete, incomplete) step numbers of the DCP step-N folders in a checkpoint
    folder. A finished Hugging Face export (`checkpoint.last_save_in_hf`: config.json and
    safetensors, no .metadata) is neither: it is never resumed from, nor purged."""
    complete, incomplete = [], []
    root = Path(folder)
    if not root.is_dir():
        return complete, incomplete
    for entry in root.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if not match or not entry.is_dir() or is_hf_export(entry):
            continue
        (complete if (entry / ".metadata").is_file() else incomplete).append(int(match.group(1)))
    return sorted(complete), sorted(incomplete)


def is_hf_export(step_folder: Path) -> bool:
    """config.json is written last, after TorchTitan's safetensors (GammaCheckpointManager)."""
    return (step_folder / "config.json").is_file() and not (step_folder / ".metadata").is_file()


def report_incomplete_checkpoints(folder: str | os.PathLike) -> list[int]:
    """Log the checkpoint folders a killed save left behind (they are never loaded)."""
    complete, incomplete = checkpoint_steps(folder)
    if incomplete:
        logger.warning(
            f"incomplete checkpoint(s) in {folder} (a save was interrupted): "
            f"{', '.join(f'step-{s}' for s in incomplete)}; ignored. Resuming from "
            + (f"step-{complete[-1]}" if complete else "scratch (no complete checkpoint)")
        )
    return incomplete


def purge_keeping_complete(checkpointer) -> None:
    """Replacement for TorchTitan's CheckpointManager._purge_stale_checkpoints: keep the
    newest `keep_latest_k` complete checkpoints; delete older complete ones and the
    incomplete ones older than the newest complete (a newer incomplete one may be a save
    still in flight)."""
    if checkpointer.keep_latest_k <= 0 or dist.get_rank() != 0 or not os.path.isdir(checkpointer.folder):
        return
    complete, incomplete = checkpoint_steps(checkpointer.folder)
    doomed = complete[: -checkpointer.keep_latest_k]
    if complete:
        doomed += [s for s in incomplete if s < complete[-1]]
    for step in sorted(doomed):
        checkpointer.purge_queue.put(os.path.join(checkpointer.folder, f"step-{step}"))


def parameters_finite(model_parts: list[torch.nn.Module], device) -> bool:
    """Whether every parameter on every rank is finite (a collective when distributed)."""
    bad = torch.zeros((), device=device)
    for part in model_parts:
        for p in part.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel() and not torch.isfinite(local).all():
                bad.fill_(1.0)
                break
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


# --- the step guard ----------------------------------------------------------------------


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
    votes = torch.stack([loss.detach().float() * (1.0 if counts_loss else 0.0),
                         torch.tensor(1.0 if stop_requested else 0.0, device=device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(votes)
    norm = grad_norm.detach().float().reshape(1) if grad_norm is not None else torch.zeros(1, device=device)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    total, stops, norm_value = torch.cat([votes, norm.to(device)]).tolist()
    return StepVerdict(total, norm_value, stops > 0)


# --- graceful stop -------------------------------------------------------------------------


class GracefulStop:
    """SIGTERM sets a flag; the trainer checkpoints at the end of the step and exits 0.
    A watchdog ends the process with 143 if that takes longer than the grace period."""

    EXIT_TIMEOUT = 128 + signal.SIGTERM

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.requested = False
        self.done = threading.Event()
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self) -> None:
        self.done.set()
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            return
        self.requested = True
        logger.warning(f"SIGTERM: finishing this step, checkpointing it and exiting "
                       f"(at most {self.grace_seconds:g} s)")
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        if not self.done.wait(self.grace_seconds):
            logger.error(f"SIGTERM: no clean stop within gamma.reliability.stop_grace_seconds = "
                         f"{self.grace_seconds:g}; exiting without a new checkpoint")
            os._exit(self.EXIT_TIMEOUT)
