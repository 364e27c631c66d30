"""What a run folder records about each launch, so any run can be reproduced.

Every start of training (rank 0) writes a new folder `<dump_folder>/runs/<UTC time>-<n>/`
and never touches an earlier one (a resumed run adds a folder):

  config.toml   the fully resolved job config: every TorchTitan and gamma_titan key with
                the value this launch used (TOML file + CLI overrides + defaults); it
                loads back with `--job.config_file` into the same config. Paths stay as
                given: a relative one (dump_folder, dataset_path, ...) is relative to
                run.json's `cwd`, as it was for the run
  run.json      the command line (the worker's, and `gamma-titan train`'s when launched
                through it), start time, working directory, host, world size, Python and
                package versions, the project's git commit (plus whether the tree had
                local changes), and what the run reads (`reads`: each source's weight,
                tokens and epochs in this run, the tokenizer; gamma_titan/data/reads.py),
                and under SLURM the job and its restart count (`slurm_job`, `slurm_restart`)
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import tomli_w

from gamma_titan.data.cache import write_json_atomic
from gamma_titan.training.run_lock import slurm_start

RUNS_FOLDER = "runs"
LAUNCH_COMMAND_ENV = "GAMMA_TITAN_LAUNCH_COMMAND"  # set by `gamma-titan train`
PACKAGES = ("torch", "torchtitan", "torchao", "tokenizers", "datasets", "tensorboard", "tomli", "numpy",
            "gamma-titan")
REPO = Path(__file__).resolve().parents[1]


def _without_none(value):
    """TOML has no null: unset keys are left out (they load back as their default, None)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value


def config_toml(job_config) -> str:
    return tomli_w.dumps(_without_none(job_config.to_dict()))


def package_versions() -> dict[str, str | None]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state(folder: Path = REPO) -> dict | None:
    """The commit of the project checkout this code runs from, if it is one."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def write_run_record(job_config, world_size: int, argv: list[str] | None = None, reads: dict | None = None) -> Path:
    """Write this launch's record into a new folder under `<dump_folder>/runs/`; `argv`
    defaults to this process's command line; `reads`: what the run reads (data/reads.py)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    runs = Path(job_config.job.dump_folder) / RUNS_FOLDER
    runs.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    for n in range(1000):
        folder = runs / f"{stamp}-{n}"
        try:
            folder.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise RuntimeError(f"no free run-record folder under {runs}")
    (folder / "config.toml").write_text(config_toml(job_config))
    write_json_atomic(folder / "run.json", {
        "started": now.isoformat(timespec="seconds"),
        "command": list(sys.orig_argv) if argv is None else argv,  # as launched: python [-u] -m ...
        "launch_command": os.environ.get(LAUNCH_COMMAND_ENV),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "world_size": world_size,
        "packages": package_versions(),
        "git": git_state(),
        "reads": reads,
        **slurm_start(),  # the SLURM job and its restart count, where there is one
    })
    return folder
