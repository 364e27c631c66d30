"""Run a recipe's runs on this machine, each as `gamma-titan train` starts it (torchrun for
several ranks, the trainer itself for one).

A run's folder is its dump folder. A run counts as finished when its metrics.jsonl has
reached its last step, so a rerun skips it; a failed run is reported and the others go on.
With `jobs` > 1, that many runs train at once, the CPU threads split between them (on 2
cores one at a time is faster). Stopping the runner (Ctrl-C, SIGTERM) sends SIGTERM to
every run it started: the trainer checkpoints where checkpointing is on, and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gamma_titan.files import CONSOLE_LOG_FILE
from gamma_titan.progress import Eta, progress_line
from gamma_titan.recipes.plan import PlannedRun
from gamma_titan.reports.run_metrics import read_metrics


def is_finished(run_dir: Path, steps: int) -> bool:
    history = read_metrics(run_dir)
    return bool(history) and history[-1]["step"] >= steps


class _Children:
    """The process groups of the runs in flight, to stop them with the runner."""

    def __init__(self) -> None:
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def start(self, command: list[str], **kwargs) -> subprocess.Popen | None:
        with self.lock:
            if self.stopping:
                return None
            proc = subprocess.Popen(command, start_new_session=True, **kwargs)
            self.procs.add(proc)
            return proc

    def done(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.procs.discard(proc)

    def stop_all(self) -> None:
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            proc.wait()


def _train(run: PlannedRun, run_dir: Path, threads: int | None, children: _Children) -> tuple[int, float]:
    from gamma_titan.training.launch import train_command

    run_dir.mkdir(parents=True, exist_ok=True)
    command, env = train_command(run.gpus_per_node, run.argv(run_dir), run.stop_grace_seconds, threads)
    start = time.monotonic()
    with open(run_dir / CONSOLE_LOG_FILE, "a", encoding="utf-8") as log:  # a rerun appends
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(command)}\n")
        log.flush()
        proc = children.start(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        if proc is None:
            return -signal.SIGTERM, 0.0
        try:
            code = proc.wait()
        finally:
            children.done(proc)
    return code, time.monotonic() - start


def run_local(runs: list[PlannedRun], out: Path, jobs: int = 1) -> dict[str, dict]:
    """Train every unfinished run; returns run name -> {"status": "finished" | "skipped" |
    "failed (exit N)", "seconds": wall time of this call's attempt}."""
    status: dict[str, dict] = {}
    todo = []
    for run in runs:
        if is_finished(out / run.name, run.steps):
            status[run.name] = {"status": "skipped", "seconds": None}
            print(f"  {run.name}: finished before, skipped", flush=True)
        else:
            todo.append(run)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
    children = _Children()
    # The ETA weighs each run by its planned compute (a 1.5B run counts for more than a 0.1B).
    weight = {run.name: run.gpu_hours or run.steps for run in todo}
    eta, done, lock = Eta(sum(weight.values()), window=None), [0.0, 0], threading.Lock()

    def one(item: tuple[int, PlannedRun]) -> None:
        i, run = item
        print(f"  [{i}/{len(todo)}] {run.name}: training {run.steps} steps -> {out / run.name}", flush=True)
        code, seconds = _train(run, out / run.name, threads, children)
        if code == 0 and is_finished(out / run.name, run.steps):
            status[run.name] = {"status": "finished", "seconds": round(seconds, 1)}
            print(f"  [{i}/{len(todo)}] {run.name}: finished in {seconds:.0f} s", flush=True)
        else:
            status[run.name] = {"status": f"failed (exit {code})", "seconds": round(seconds, 1)}
            print(f"  [{i}/{len(todo)}] {run.name}: FAILED (exit {code}) after {seconds:.0f} s; "
                  f"see {out / run.name / CONSOLE_LOG_FILE}", flush=True)
        with lock:
            done[0] += weight[run.name]
            done[1] += 1
            elapsed, left = eta.update(done[0])
            line = progress_line(done[1], len(todo), elapsed, left, unit="runs done:")
            print(f"  {line}", flush=True)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        list(pool.map(one, enumerate(todo, 1)))
    except KeyboardInterrupt:
        print("  stopping: SIGTERM to the runs in flight", flush=True)
        children.stop_all()
        raise
    finally:
        pool.shutdown(wait=True)
        signal.signal(signal.SIGTERM, previous)
    return {run.name: status[run.name] for run in runs}
