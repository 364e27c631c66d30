"""One live run per dump folder: `<dump_folder>/.run.lock` names the run that holds it (host,
pid, start time) and is refreshed every HEARTBEAT_SECONDS while it trains. A second launch
into the folder is refused in one line naming that run. A lock whose run is gone does not
block: on the same host, its pid is not alive; on another host, its heartbeat is older
than STALE_SECONDS (a process on another machine cannot be asked)."""

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


def holder(dump_folder: str | os.PathLike) -> dict | None:
    """The live run holding `dump_folder`, or None (no lock, or one left by a dead run)."""
    path = Path(dump_folder) / LOCK_FILE
    try:
        held = json.loads(path.read_text(encoding="utf-8"))
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None
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
    if held is not None:
        raise ConfigError(f"{key}: {dump_folder} is in use by a live run (host {held['host']}, pid {held['pid']}, "
                          f"started {held['started']}); wait for it to end, stop it, or use another {key}")


class RunLock:
    """Held by rank 0 from before its run record until the run ends."""

    def __init__(self, dump_folder: str | os.PathLike):
        self.path = Path(dump_folder) / LOCK_FILE
        self._stop = threading.Event()

    def acquire(self) -> "RunLock":
        check_free(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, self.path)  # a lock of a dead run is replaced
        threading.Thread(target=self._heartbeat, daemon=True).start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text(encoding="utf-8")).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass
