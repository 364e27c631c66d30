"""What a run's folder records about its SLURM jobs, in `<dump_folder>/slurm/`:

  jobs.jsonl     one line per submission: the job id, when, the script, its log
  starts.jsonl   one line when a start begins (its job, start and attempt, the nodes, the
                 step and checkpoint it begins from, the time limit) and one when it ends
                 (the verdict and why: the time limit, a preemption, an administrator's
                 requeue, a person's stop, a failure), written by the job itself

SLURM's own records cannot tell a time limit from a preemption or a requeue (every one ends
as a requeue, or the same COMPLETED); these can. `gamma-titan status` reads them, with the
run's metrics, checkpoints and run records.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


SLURM_FOLDER = "slurm"
JOBS_FILE = "jobs.jsonl"
STARTS_FILE = "starts.jsonl"


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, appended whole (one write of one line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a .jsonl file; a line cut short (a job killed while writing) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def jobs(run_dir: Path) -> list[dict[str, Any]]:
    return read_lines(Path(run_dir) / SLURM_FOLDER / JOBS_FILE)


def starts(run_dir: Path) -> list[dict[str, Any]]:
    return read_lines(Path(run_dir) / SLURM_FOLDER / STARTS_FILE)


def record_submission(run_dir: Path, job: str, script: Path, log: Path, command: str) -> None:
    append_line(Path(run_dir) / SLURM_FOLDER / JOBS_FILE,
                {"job": job, "submitted": now_iso(), "script": str(script), "log": str(log), "command": command})


@dataclass
class Progress:
    """Where a run stands, read from its folder."""

    step: int | None  # the last logged step
    target: int | None  # training.steps of its newest run record
    checkpoint: int | None  # the newest complete checkpoint's step
    eta_s: float | None  # the last logged step's ETA, less the time since it was logged
    step_seconds: float | None  # the recent seconds per step


def newest_run_record(run_dir: Path, job: str | None = None, restart: int | None = None) -> Path | None:
    """The newest `runs/<start>/` folder (with `job`: one written by that SLURM job's start
    `restart`)."""
    from gamma_titan.training.run_record import RUNS_FOLDER

    for folder in sorted((Path(run_dir) / RUNS_FOLDER).glob("*/"), reverse=True):
        if job is None:
            return folder
        try:
            record = json.loads((folder / "run.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if str(record.get("slurm_job")) == job and record.get("slurm_restart") == restart:
            return folder
    return None


def record_settings(folder: Path | None) -> tuple[int | None, str]:
    """training.steps and checkpoint.folder of a run record (None, "checkpoint" without one)."""
    import tomllib

    if folder is None:
        return None, "checkpoint"
    try:
        config = tomllib.loads((folder / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "checkpoint"
    steps = config.get("training", {}).get("steps")
    return (steps if isinstance(steps, int) else None), config.get("checkpoint", {}).get("folder", "checkpoint")


def progress(run_dir: Path, record: Path | None = None) -> Progress:
    """The run's last logged step, its target (from `record`, default the newest run
    record), its newest complete checkpoint and its ETA."""
    from gamma_titan.files import METRICS_FILE
    from gamma_titan.reports.run_metrics import read_metrics
    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    run_dir = Path(run_dir)
    target, ckpt_folder = record_settings(record or newest_run_record(run_dir))
    metrics = [r for r in read_metrics(run_dir) if "loss" in r]
    step = metrics[-1]["step"] if metrics else None
    eta = step_s = None
    if metrics:
        last = metrics[-1]
        if isinstance(last.get("eta_s"), (int, float)):
            age = max(0.0, datetime.datetime.now().timestamp() - os.path.getmtime(run_dir / METRICS_FILE))
            eta = max(0.0, last["eta_s"] - age)
        same_start = [r for r in metrics[-5:] if isinstance(r.get("elapsed_s"), (int, float))]
        pairs = [(a, b) for a, b in zip(same_start, same_start[1:]) if b["elapsed_s"] > a["elapsed_s"]]
        if pairs:
            step_s = sum(b["elapsed_s"] - a["elapsed_s"] for a, b in pairs) / sum(b["step"] - a["step"] for a, b in pairs)
    complete, _ = checkpoint_steps(run_dir / ckpt_folder)
    return Progress(step, target, complete[-1] if complete else None, eta, step_s)
