"""Processes a check starts, bounded in time, and gone (with their hold on the GPU) when it ends.

torchrun starts its workers in sessions of their own, so killing torchrun's process group
leaves them running, holding the GPU. The driver therefore makes itself a child
subreaper (Linux prctl): every process a check starts stays its descendant, even once
its parent has died, and `kill_descendants` finds them all through /proc. Before the
next check starts, `wait_released` checks that none is left and that the GPU's memory
is back to where it was before the checks began (nvidia-smi; pids alone are not enough
inside a container, where nvidia-smi may not see them).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
#: The GPU counts as released when its used memory is within this of the baseline.
RELEASED_SLACK_MIB = 1024
#: How long a finished check's processes and GPU memory may take to go.
RELEASE_TIMEOUT_S = 30.0


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux only)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


#: Descendants that were there before the checks (gpu_check.sh's `tee` of the console, a
#: child of this process once bash exec'd it): never killed, never waited for.
SPARED: set[int] = set()


def spare_current_descendants() -> None:
    """Spare every descendant alive now from `kill_descendants` and `wait_released`."""
    SPARED.update(descendants())


def descendants(root: int | None = None) -> list[int]:
    """Live (non-zombie) descendants of `root` (default: this process), from /proc, but
    the SPARED ones and theirs."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in SPARED:
                found.append(child)
                todo.append(child)
    return found


def reap() -> None:
    """Collect exited children (orphans re-parented here become our zombies otherwise)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants(grace: float = 5.0) -> list[int]:
    """SIGTERM, then after `grace` seconds SIGKILL, every descendant of this process; the
    pids that are still alive afterwards ([] when all are gone)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for pid in descendants():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while descendants() and time.monotonic() < deadline:
            reap()
            time.sleep(0.1)
        reap()
        if not descendants():
            return []
    return descendants()


def gpu_memory_used_mib() -> list[int] | None:
    """Used memory of each GPU (nvidia-smi), or None where nvidia-smi is absent."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None
    return [int(float(v)) for v in out.stdout.split()]


def wait_released(baseline: list[int] | None, timeout: float | None = None) -> str | None:
    """None once no descendant is alive and every GPU's memory is back within
    RELEASED_SLACK_MIB of `baseline`; else what still holds on, after `timeout` seconds
    (RELEASE_TIMEOUT_S)."""
    deadline = time.monotonic() + (RELEASE_TIMEOUT_S if timeout is None else timeout)
    while True:
        reap()
        alive = descendants()
        used = gpu_memory_used_mib() if baseline is not None else None
        held = [(i, u, b) for i, (u, b) in enumerate(zip(used or [], baseline or [])) if u > b + RELEASED_SLACK_MIB]
        if not alive and not held:
            return None
        if time.monotonic() > deadline:
            parts = [f"processes {alive} still alive"] if alive else []
            parts += [f"GPU {i} holds {u} MiB (baseline {b} MiB)" for i, u, b in held]
            return "; ".join(parts)
        time.sleep(0.5)


@dataclass
class Finished:
    code: int | None  # None: killed at the deadline
    seconds: float
    output: str

    @property
    def timed_out(self) -> bool:
        return self.code is None


def run_until(command: list[str], log: Path, deadline: float, env: dict | None = None, cwd: Path | None = None,
              on_poll=None) -> Finished:
    """Run `command` (output into `log`) until it exits or the monotonic `deadline`
    passes; then everything it started is killed. `on_poll(proc)`, called every 0.2 s,
    may act on the run (the SIGTERM drill signals it); it returns True to stop polling."""
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        polling = on_poll is not None
        while proc.poll() is None and time.monotonic() < deadline:
            if polling and on_poll(proc):
                polling = False
            time.sleep(0.2)
        code = proc.poll()
        if code is None:
            kill_descendants()
    return Finished(code, time.monotonic() - start, log.read_text(errors="replace"))
