"""One live run per dump folder: `<dump_folder>/.run.lock` names the run that holds it (host,
pid, start time, and its SLURM job and restart count under SLURM) and is refreshed every
HEARTBEAT_SECONDS while it trains. A second launch into the folder is refused in one line
naming that run. A lock whose run is gone does not block: on the same host, its pid is not
alive; on another host, its heartbeat is older than STALE_SECONDS (a process on another
machine cannot be asked); and a lock of an earlier start of this very SLURM job (a requeue,
whose rank 0 may land on another node within minutes) is that job's own. The holder gives
the lock up as soon as its stop checkpoint is written (main.py)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path

from gamma_titan.errors import ConfigError

LOCK_FILE = ".run.lock"
HEARTBEAT_SECONDS = 60.0
STALE_SECONDS = 5 * HEARTBEAT_SECONDS


def slurm_start() -> dict:
    """This process's SLURM job and how often it was restarted (requeued); {} outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job": job, "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0"))} if job else {}


def holder(dump_folder: str | os.PathLike) -> dict | None:
    """The live run holding `dump_folder`, or None (no lock, one left by a dead run, or one of
    an earlier start of this SLURM job)."""
    path = Path(dump_folder) / LOCK_FILE
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not isinstance(held, dict):  # damaged: no run's record
        return None
    ours = slurm_start()
    if ours and held.get("slurm_job") == ours["slurm_job"] and held.get("slurm_restart", 0) < ours["slurm_restart"]:
        return None  # this job before its requeue: whatever ran then is over
    held["age"] = age
    if held.get("host") == socket.gethostname():
        if held.get("pid") == os.getpid():
            return None  # this process (a launcher that trains in-process)
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
        return held
    return held if age < STALE_SECONDS else None


def check_free(dump_folder: str | os.PathLike, key: str = "job.dump_folder") -> None:
    held = holder(dump_folder)
    if held is None:
        return
    job = f", SLURM job {held['slurm_job']}" if held.get("slurm_job") else ""
    who = f"(host {held['host']}, pid {held['pid']}{job}, started {held['started']})"
    if held["host"] == socket.gethostname():
        raise ConfigError(f"{key}: {dump_folder} is in use by a live run {who}; wait for it to end, stop it, or use "
                          f"another {key}")
    raise ConfigError(f"{key}: {dump_folder} is in use by a run on another host {who}, alive {held['age']:.0f} s ago "
                      f"(it counts as gone {STALE_SECONDS:.0f} s after its last heartbeat); if that host is down, "
                      f"delete {Path(dump_folder) / LOCK_FILE} to take the folder over")


class RunLock:
    """Held by rank 0 from before its run record until the run ends."""

    def __init__(self, dump_folder: str | os.PathLike):
        self.path = Path(dump_folder) / LOCK_FILE
        self._stop = threading.Event()

    def acquire(self) -> "RunLock":
        check_free(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), **slurm_start()}
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, self.path)  # a lock of a dead run is replaced
        threading.Thread(target=self._heartbeat, daemon=True).start()
        return self

    def _heartbeat(self) -> None:
        """Touch the lock every HEARTBEAT_SECONDS; a failed touch (a file server's hiccup) is
        said once and tried again at the next beat."""
        failing = False
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
                failing = False
            except OSError as e:
                if not failing:
                    from torchtitan.tools.logging import logger

                    logger.warning(f"run lock {self.path}: heartbeat failed ({e}); trying again in "
                                   f"{HEARTBEAT_SECONDS:g} s")
                failing = True

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text(encoding="utf-8")).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass
