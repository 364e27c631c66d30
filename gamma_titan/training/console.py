"""What a run says, and where: the console, and the run folder's own log.

* `train.log` in job.dump_folder (rank 0): every line the console gets, without colour
  codes, written line by line (a FileHandler on TorchTitan's logger; appended on resume).
* Colour: TorchTitan colours its step line unless `metrics.disable_color_printing`. Where
  the output is not a terminal (a SLURM log, a pipe, a file) or NO_COLOR is set, the
  console's lines lose their colour codes too; torchrun's workers write to a pipe, so
  `gamma-titan train` sets FORCE_COLOR for them when its own output is a terminal.
* Noise: on a CPU TorchTitan looks for a GPU's peak FLOPs (lspci, then "fallback to A100"),
  which means nothing there; those lines give way to one that says so. Its autocast to
  float32 on a CPU warns that CPU autocast takes bf16/fp16 only (float32 needs no autocast:
  nothing changes), and torchdata warns about its own use of a deprecated call; both are
  silenced.
* The end: where the checkpoints, metrics.jsonl, TensorBoard events and this log are, and
  the commands that resume and convert the run.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import warnings
from pathlib import Path

from gamma_titan.files import METRICS_FILE, RUN_LOG_FILE, step_folder

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: TorchTitan's lines about a GPU's peak FLOPs, which a CPU run has no use for.
_PEAK_FLOPS_NOISE = ("Error running lspci", "Peak flops undefined for", "Peak FLOPS used for computing MFU")


def wants_colour() -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty()


class _Plain(logging.Formatter):
    """Another formatter's lines, without colour codes."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", self.inner.format(record))


class _CpuPeakFlops(logging.Filter):
    """Drops TorchTitan's peak-FLOPs lines on a CPU and says once what its MFU means there."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(_PEAK_FLOPS_NOISE):
            return True
        if not self.said:
            self.said = True
            record.msg, record.args, record.levelno, record.levelname = (
                "mfu: measured against an A100's peak FLOPs (TorchTitan's fallback): it means nothing on a CPU",
                None, logging.INFO, "INFO")
            return True
        return False


def set_up(config, device_type: str, rank: int) -> Path | None:
    """Colour, the CPU's noise filter, and (rank 0) the run's log file; returns its path."""
    root = logging.getLogger()  # TorchTitan's logger
    if not wants_colour():
        for handler in root.handlers:  # init_logger's console handler
            handler.setFormatter(_Plain(handler.formatter or logging.Formatter()))
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata's own call
    if device_type == "cpu":
        root.addFilter(_CpuPeakFlops())
        if config.training.mixed_precision_param == "float32":
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    if rank != 0:
        return None
    path = Path(config.job.dump_folder) / RUN_LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")  # flushed after every record
    handler.setFormatter(_Plain(logging.Formatter("[titan] %(asctime)s - %(levelname)s - %(message)s")))
    root.addHandler(handler)
    return path


def ending(config, launch_command: str | None) -> list[str]:
    """The last lines of a run: where everything is, and what to run next."""
    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    dump = Path(config.job.dump_folder).resolve()
    lines = [f"run folder: {dump}", f"  log: {dump / RUN_LOG_FILE}", f"  metrics: {dump / METRICS_FILE}"]
    if config.metrics.enable_tensorboard:
        lines.append(f"  TensorBoard: tensorboard --logdir {dump / config.metrics.save_tb_folder}")
    command = launch_command or " ".join(shlex.quote(a) for a in ["python", "-m", "gamma_titan.train", *sys.argv[1:]])
    if not config.checkpoint.enable:
        lines.append("  checkpoints: none (checkpoint.enable = false): nothing to resume or convert")
        return lines
    folder = dump / config.checkpoint.folder
    complete, _ = checkpoint_steps(folder)
    if not complete:
        lines.append(f"  checkpoints: none complete in {folder}")
        return lines
    last = folder / step_folder(complete[-1])
    lines.append(f"  last checkpoint: {last}")
    if config.checkpoint.last_save_model_only and complete[-1] >= config.training.steps:
        lines.append(f"  train on from it (the last save holds the model only): a new --job.dump_folder with "
                     f"--checkpoint.initial_load_path {last}")
    else:
        lines.append(f"  resume (or extend it with a larger --training.steps): {command}")
    lines.append(f"  convert to Hugging Face: gamma-titan convert to-hf {last} {dump / 'hf'}")
    return lines
