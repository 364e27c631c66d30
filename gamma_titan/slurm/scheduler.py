"""The SLURM commands the launcher side calls (sbatch, squeue, scontrol), each in one place,
each failure a one-line ConfigError."""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
from pathlib import Path

from gamma_titan.errors import ConfigError

#: squeue's states of a job that is not over.
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD")


def command(name: str, why: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"no {name} on PATH ({why})")
    return path


def sbatch(script: Path) -> str:
    """Submit `script`; its job id."""
    done = subprocess.run([command("sbatch", "use --dry-run to only write the script"), "--parsable", str(script)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        message = (done.stderr.strip() or f"exit {done.returncode}").splitlines()[-1]
        raise ConfigError(f"sbatch {script}: {message}")
    return done.stdout.strip().split(";")[0]


def queued(job_ids: list[str], script: Path | None = None) -> list[tuple[str, str]]:
    """(job id, state) of this user's jobs that are not over and are one of `job_ids` or run
    `script` (a job submitted by hand with `sbatch SCRIPT` too). [] without squeue."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return []
    done = subprocess.run([squeue, "-h", "-u", getpass.getuser(), "-o", "%i|%T|%o"], capture_output=True, text=True)
    if done.returncode != 0:
        return []
    found = []
    for line in done.stdout.splitlines():
        job, state, cmd = (line.split("|", 2) + ["", ""])[:3]
        if state in LIVE_STATES and (job in job_ids or (script is not None and cmd == str(script))):
            found.append((job, state))
    return found


def job_fields(job: str) -> dict[str, str]:
    """`scontrol show job` as key -> value ({} when SLURM no longer knows the job)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return {}
    done = subprocess.run([scontrol, "show", "job", job], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}
