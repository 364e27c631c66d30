"""`<dump_folder>/metrics.jsonl`: one JSON object per logged step, next to TensorBoard.

TorchTitan's MetricsProcessor computes the numbers (loss, grad norm, throughput, MFU,
memory) and hands them to its loggers; this adds one logger that writes them as JSON
lines with short names (`step`, `loss`, `grad_norm`, `lr`, `tps`, `val_loss`, ...) and
all of TorchTitan's own keys. When validation runs at a step, its loss goes into that
step's object, so each step has exactly one line. The file is appended to, never
truncated: a resumed run continues it.

TensorBoard gets one run per dump folder (`<dump_folder>/<metrics.save_tb_folder>/`, where
TorchTitan makes a new `<time>/` run at every launch): a resumed or extended run appends
to it, and a restart from an earlier checkpoint purges what the folder holds from the
resumed step on (TensorBoard's `purge_step`), so each curve is one line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    TensorBoardLogger,
    _get_metrics_rank,
)
from torchtitan.tools.logging import logger

from gamma_titan.diagnostics.live import cosine_image, diagnostics_due
from gamma_titan.files import METRICS_FILE, SOURCE_VAL_LOSS
from gamma_titan.progress import Eta, progress_line


# TorchTitan's key -> our short name.
_SHORT_NAMES = {
    "loss_metrics/global_avg_loss": "loss",
    "loss_metrics/global_max_loss": "max_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "throughput(tps)": "tps",
    "tflops": "tflops",
    "mfu(%)": "mfu",
    "n_tokens_seen": "tokens_seen",
    "memory/max_reserved(GiB)": "memory_gib",
    "validation_metrics/loss": "val_loss",
    "time/elapsed_s": "elapsed_s",
    "time/eta_s": "eta_s",
}


#: The key of a mixture source's validation loss (TorchTitan's naming; validator.py logs it).
SOURCE_LOSS_PREFIX = "validation_metrics/loss/"
#: TorchTitan-style prefix -> our short one.
_SHORT_PREFIXES = {SOURCE_LOSS_PREFIX: SOURCE_VAL_LOSS}


def short_name(key: str) -> str:
    """The metrics.jsonl name of a TorchTitan metric key."""
    for prefix, short in _SHORT_PREFIXES.items():
        if key.startswith(prefix):
            return short + key[len(prefix):]
    return _SHORT_NAMES.get(key, key)


class JsonlLogger(BaseLogger):
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a", buffering=1)  # line-buffered: readable while running

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            record[short_name(key)] = value
        self._file.write(json.dumps(record) + "\n")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.write(step, metrics)

    def close(self) -> None:
        self._file.close()


class RunTensorBoard(TensorBoardLogger):
    """TorchTitan's TensorBoard logger, writing every launch of a run into one folder. Its
    writer opens at the first scalar, once the run knows the step it resumed from: events
    of an earlier launch from that step on are purged (`purge_step`)."""

    def __init__(self, log_dir: str, tag: str | None = None):  # no writer yet (TorchTitan's opens one)
        self.tag, self.log_dir = tag, log_dir
        self.purge_step = 1  # a run that starts over replaces whatever the folder held
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, max_queue=1000, purge_step=self.purge_step)
            logger.info(f"TensorBoard: {self.log_dir} (from step {self.purge_step} on)")
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class GammaMetricsProcessor(MetricsProcessor):
    """TorchTitan's processor; training and validation metrics of one step share a line, and
    TensorBoard has one run per dump folder (RunTensorBoard)."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        metrics = job_config.metrics
        tensorboard, metrics.enable_tensorboard = metrics.enable_tensorboard, False  # ours replaces TorchTitan's
        try:
            super().__init__(job_config, parallel_dims, tag)
        finally:
            metrics.enable_tensorboard = tensorboard
        rank = torch.distributed.get_rank()
        # TorchTitan's choice: rank 0, or under pipeline parallelism the first rank of the
        # last stage, which holds the loss (the other stages log a placeholder).
        self.writes = rank == _get_metrics_rank(parallel_dims, job_config)
        if tensorboard and (self.writes or metrics.save_for_all_ranks):
            folder = os.path.join(job_config.job.dump_folder, metrics.save_tb_folder)
            if job_config.fault_tolerance.enable:  # TorchTitan's layout, less its <time>/ folder
                folder = os.path.join(folder, f"replica_{job_config.fault_tolerance.replica_id}")
            if metrics.save_for_all_ranks:
                folder = os.path.join(folder, f"rank_{rank}")
            container = self.logger if isinstance(self.logger, LoggerContainer) else LoggerContainer()
            container.add_logger(RunTensorBoard(folder, tag))
            self.logger = container
        self.jsonl: JsonlLogger | None = None
        if self.writes:
            self.jsonl = JsonlLogger(os.path.join(job_config.job.dump_folder, METRICS_FILE))
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._loggers = self.logger  # TensorBoard / W&B, as TorchTitan built them
        self.logger = _Tee(self)
        # Set by GammaTrainer; TorchTitan's own Trainer (`-m torchtitan.train`) runs none.
        self.diagnostics_attached = False
        self.eta = Eta(job_config.training.steps)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        """TorchTitan's log, plus the MoE expert load (a collective: all ranks log)."""
        from gamma_titan.models.common.moe import moe_load_metrics

        dims = self.parallel_dims
        # the ranks that hold different tokens: the batch's, and under CP the sequence chunks'
        group = dims.get_mesh("loss" if dims.cp_enabled else "batch").get_group() \
            if dims.dp_enabled or dims.cp_enabled else None
        pp_group = dims.get_mesh("pp").get_group() if dims.pp_enabled else None
        elapsed, left = self.eta.update(step)
        extra = {**(extra_metrics or {}), **moe_load_metrics(self.model_parts or [], group, pp_group),
                 "time/elapsed_s": round(elapsed, 1), **({} if left is None else {"time/eta_s": round(left, 1)})}
        if step == 1 and self.job_config.gamma.diagnostics.enable and not self.diagnostics_attached:
            logger.warning("gamma.diagnostics.enable is true, but this trainer does not run diagnostics: "
                           "launch with -m gamma_titan.train (or gamma-titan train)")
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        logger.info(progress_line(step, self.eta.total, elapsed, left))

    # --- diagnostics (gamma_titan/diagnostics) ------------------------------------------

    def resumed_at(self, step: int) -> None:
        """The run resumed from a checkpoint of `step` (the trainer's train_state): TensorBoard
        keeps what an earlier launch logged up to it and drops the rest."""
        for tb in self._tensorboards:
            if isinstance(tb, RunTensorBoard):
                tb.purge_step = step + 1

    @property
    def _tensorboards(self) -> list[TensorBoardLogger]:
        loggers = getattr(self._loggers, "_loggers", [])  # a bare BaseLogger when none is on
        return [l for l in loggers if isinstance(l, TensorBoardLogger)]

    @property
    def has_image_logger(self) -> bool:
        """Whether row-cosine maps have somewhere to go (the same answer on every rank)."""
        return self.job_config.metrics.enable_tensorboard

    def log_diagnostics(self, step: int, metrics: dict[str, float], maps: dict[str, torch.Tensor]) -> None:
        """gamma/* scalars into the step's line, TensorBoard and metrics.jsonl; row-cosine
        maps as TensorBoard images."""
        self.logger.log(metrics, step)
        for tb in self._tensorboards:
            for tag, similarity in maps.items():
                tb.writer.add_image(tag, cosine_image(similarity), step, dataformats="HWC")
        if self.writes:
            sinks = metrics.get("gamma/sink_score/mean")
            logger.info(
                f"diagnostics step {step}: sink score {sinks if sinks is None else round(sinks, 4)}, "
                f"residual flow {metrics.get('gamma/residual_flow_ratio', float('nan')):.4g}, "
                f"{len(metrics)} tags in {metrics.get('gamma/diagnostics_seconds', 0):.2f}s"
            )

    def add_event(self, step: int, events: dict[str, Any]) -> None:
        """Step events (a skipped update, a loss spike) into that step's metrics.jsonl line;
        called during the step, before its metrics are logged."""
        if self._pending is not None and self._pending[0] != step:
            self._flush()
        if self._pending is None:
            self._pending = (step, {})
        self._pending[1].update(events)

    # --- one line per step --------------------------------------------------------------

    def _stages_due(self, step: int) -> list[str]:
        """What reports at a step, in the order the trainer reports it."""
        v = self.job_config.validation
        due = {
            "train": self.should_log(step),
            "diagnostics": self.diagnostics_attached and diagnostics_due(self.job_config.gamma.diagnostics, step),
            "validation": v.enable and (step == 1 or step % v.freq == 0),
        }
        return [stage for stage, is_due in due.items() if is_due]

    @staticmethod
    def _stage(metrics: dict[str, Any]) -> str:
        if any(k.startswith("validation_metrics/") for k in metrics):
            return "validation"
        if any(k.startswith("gamma/") for k in metrics):
            return "diagnostics"
        return "train"

    def _emit(self, step: int, metrics: dict[str, Any]) -> None:
        if self._pending is not None and self._pending[0] != step:
            self._flush()
        if self._pending is None:
            self._pending = (step, dict(metrics))
        else:
            self._pending[1].update(metrics)
        due = self._stages_due(step)
        if not due or self._stage(metrics) == due[-1]:  # the step's last report: write the line
            self._flush()

    def _flush(self) -> None:
        if self._pending is not None and self.jsonl is not None:
            self.jsonl.write(*self._pending)
        self._pending = None

    def close(self) -> None:
        self._flush()
        if self.jsonl is not None:
            self.jsonl.close()
        self._loggers.close()


class _Tee(LoggerContainer):
    """Sends each batch of metrics to TorchTitan's loggers and to metrics.jsonl."""

    def __init__(self, processor: GammaMetricsProcessor):
        super().__init__()
        self._processor = processor

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._processor._loggers.log(metrics, step)
        self._processor._emit(step, metrics)

    def close(self) -> None:
        pass  # the processor closes everything


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None) -> MetricsProcessor:
    return GammaMetricsProcessor(job_config, parallel_dims, tag)
