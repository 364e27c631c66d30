"""Site settings: what a team writes once about its SLURM cluster, and every job reuses.

A site file is TOML (`gamma-titan submit --site FILE`, or the file `$GAMMA_TITAN_SLURM_SITE`
names); `submit`'s flags override it key by key. Every setting ends up in the job script as
an `#SBATCH` line or a line the script runs, so `sbatch SCRIPT` alone submits the same job
again.

    partition = "gpu"                  # #SBATCH --partition
    account = "proj42"                 # #SBATCH --account
    qos = "normal"                     # #SBATCH --qos
    constraint = "h100"                # #SBATCH --constraint
    time = "2-00:00:00"                # #SBATCH --time (none: the partition's default)
    gpus_per_node = 8                  # #SBATCH --gpus-per-node, and the ranks per node
    cpus_per_task = 96                 # #SBATCH --cpus-per-task (none: the node's CPUs, --exclusive)
    exclusive = true                   # #SBATCH --exclusive (the default)
    sbatch = ["--mail-type=END"]       # more #SBATCH lines, as given
    setup = ["module load cuda/12.4", "source /shared/gt/.venv/bin/activate"]   # run before training
    python = "python"                  # the nodes' Python (default: this one, unless setup or a container)
    [env]                              # exported before training
    NCCL_SOCKET_IFNAME = "ib0"
    [container]                        # one of:
    image = "/shared/gt.sqsh"          #   pyxis: srun --container-image (and mounts, workdir)
    mounts = ["/shared:/shared"]
    prefix = "apptainer exec --nv /shared/gt.sif"   # or any command the nodes' Python runs under

Unknown keys, a value of the wrong type, an `#SBATCH` line that would fight the script's own
(the node count, the log, the requeue) are refused in one line naming the file and the key.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError

#: The environment variable naming a site file when `--site` does not.
SITE_ENV = "GAMMA_TITAN_SLURM_SITE"

#: SLURM's time formats: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")

#: #SBATCH options the job script sets itself, each with the setting to use instead.
OWN_SBATCH_OPTIONS = {
    "--nodes": "--nodes", "-N": "--nodes", "--ntasks-per-node": "(one task per node: torchrun starts the ranks)",
    "--ntasks": "(one task per node: torchrun starts the ranks)", "-n": "(one task per node)",
    "--gpus-per-node": "gpus_per_node", "--output": "(the log goes to the run folder's slurm/)",
    "-o": "(the log goes to the run folder's slurm/)", "--error": "(stderr goes to the log)",
    "-e": "(stderr goes to the log)", "--open-mode": "(the log is appended across requeues)",
    "--signal": "(the job signals itself before its time limit)", "--requeue": "(always on)",
    "--no-requeue": "(the job requeues itself at its time limit)", "--job-name": "(gt-<run folder>)",
    "-J": "(gt-<run folder>)", "--partition": "partition", "-p": "partition", "--account": "account",
    "-A": "account", "--qos": "qos", "-q": "qos", "--constraint": "constraint", "-C": "constraint",
    "--time": "time", "-t": "time", "--exclusive": "exclusive", "--cpus-per-task": "cpus_per_task",
    "-c": "cpus_per_task", "--chdir": "(the job runs where submit ran)", "-D": "(the job runs where submit ran)",
}


def time_minutes(text: str) -> float | None:
    """SLURM's --time as minutes (None: "UNLIMITED" / "INFINITE"), or a ValueError."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(text)
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-H[:M[:S]]
        return days * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    if c is not None:  # H:M:S
        return a * 60 + b + c / 60
    if b is not None:  # M:S
        return a + b / 60
    return float(a)  # M


@dataclass(frozen=True)
class Container:
    """pyxis (`image`, `mounts`, `workdir`: srun's --container-* options), or a `prefix` the
    nodes' commands run under (apptainer, enroot, a wrapper script)."""

    image: str | None = None
    mounts: tuple[str, ...] = ()
    workdir: str | None = None
    prefix: str | None = None

    def srun_options(self) -> list[str]:
        if self.image is None:
            return []
        return ([f"--container-image={self.image}"]
                + ([f"--container-mounts={','.join(self.mounts)}"] if self.mounts else [])
                + ([f"--container-workdir={self.workdir}"] if self.workdir else []))


@dataclass(frozen=True)
class Site:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    exclusive: bool = True
    sbatch: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    python: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    container: Container = field(default_factory=Container)
    source: str | None = None  # the file it was read from, for messages

    def nodes_python(self) -> str:
        """The Python the job runs: `python`, or this one where the nodes share its path
        (no setup lines that may activate another, no container with a Python of its own)."""
        if self.python:
            return self.python
        return "python" if self.setup or self.container.image or self.container.prefix else sys.executable

    def time_limit_minutes(self) -> float | None:
        return None if self.time is None else time_minutes(self.time)

    def sbatch_lines(self) -> list[str]:
        """The #SBATCH options the site adds (partition, account, ... and its own lines)."""
        own = [f"--{name}={value}" for name, value in (("partition", self.partition), ("account", self.account),
                                                       ("qos", self.qos), ("constraint", self.constraint),
                                                       ("time", self.time), ("cpus-per-task", self.cpus_per_task))
               if value is not None]
        return own + (["--exclusive"] if self.exclusive else []) + list(self.sbatch)

    def merged(self, **flags: Any) -> "Site":
        """This site with the flags that were given (None: not given) taking precedence;
        --sbatch lines add to the site's."""
        changes = {k: v for k, v in flags.items() if v is not None and k != "sbatch"}
        extra = tuple(flags.get("sbatch") or ())
        replace(Site(), sbatch=extra, time=changes.get("time")).check("--")  # named as flags
        return replace(self, **changes, sbatch=self.sbatch + extra)

    def check(self, at: str | None = None) -> None:
        """Values that would write a broken script (the flags' own types are argparse's);
        `at` prefixes the key in messages (default: the site file)."""
        at = at if at is not None else f"{self.source}: " if self.source else ""
        if self.time is not None:
            try:
                time_minutes(self.time)
            except ValueError:
                raise ConfigError(f"{at}time = {self.time!r}: not a SLURM time (minutes, M:S, H:M:S, D-H, D-H:M or "
                                  "D-H:M:S, or UNLIMITED)") from None
        for line in self.sbatch:
            option = line.split("=", 1)[0].split()[0] if line.strip() else ""
            if not option.startswith("-"):
                raise ConfigError(f"{at}sbatch: {line!r} is not an sbatch option (e.g. \"--mail-type=END\")")
            if option in OWN_SBATCH_OPTIONS:
                instead = OWN_SBATCH_OPTIONS[option]
                use = instead if instead.startswith("(") else f"(use {instead})"
                raise ConfigError(f"{at}sbatch: {line!r}: the job script sets {option} itself {use}")
        if self.container.image and self.container.prefix:
            raise ConfigError(f"{at}container: give image (pyxis) or prefix (apptainer, enroot, ...), not both")
        for name, value in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ConfigError(f"{at}env.{name}: not an environment variable name")


#: Each top-level key of a site file and the type of its value.
_KEYS = {"partition": str, "account": str, "qos": str, "constraint": str, "time": (str, int), "gpus_per_node": int,
         "cpus_per_task": int, "exclusive": bool, "sbatch": list, "setup": list, "python": str, "env": dict,
         "container": dict}
_CONTAINER_KEYS = {"image": str, "mounts": list, "workdir": str, "prefix": str}


def _typed(value: Any, kind, key: str, path: Path) -> Any:
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{path}: {key} = {value!r}: must be {_kind_name(kind)}")
    if not isinstance(value, kind):
        raise ConfigError(f"{path}: {key} = {value!r}: must be {_kind_name(kind)}")
    if kind is list and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {key}: every entry must be a string")
    if kind is int and value < (1 if key == "cpus_per_task" else 0):
        raise ConfigError(f"{path}: {key} = {value}: must be >= {1 if key == 'cpus_per_task' else 0}")
    return value


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", int: "an integer", bool: "true or false", list: "a list of strings",
             dict: "a table"}
    return " or ".join(names[k] for k in kinds)


def read_site(path: str | os.PathLike) -> Site:
    """The site file at `path`, checked."""
    from gamma_titan.file_reads import read_toml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"site file {path}: no such file")
    data = read_toml(path, "the site file: fix the line it names")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(_KEYS)}")
    values = {key: _typed(value, _KEYS[key], key, path) for key, value in data.items()}
    container = values.pop("container", {})
    unknown = sorted(set(container) - set(_CONTAINER_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key container.{unknown[0]!r}; allowed: {', '.join(_CONTAINER_KEYS)}")
    container = {k: _typed(v, _CONTAINER_KEYS[k], f"container.{k}", path) for k, v in container.items()}
    env = values.pop("env", {})
    for name, value in env.items():
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{path}: env.{name} = {value!r}: must be a string or a number")
    env = tuple((name, _env_text(value)) for name, value in env.items())
    if "time" in values:
        values["time"] = str(values["time"])
    for key in ("sbatch", "setup"):
        if key in values:
            values[key] = tuple(values[key])
    site = Site(**values, env=env, source=str(path),
                container=Container(**{k: tuple(v) if k == "mounts" else v for k, v in container.items()}))
    site.check()
    return site


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def load_site(path: str | None) -> Site:
    """The site file named by `--site`, else by $GAMMA_TITAN_SLURM_SITE, else no settings."""
    named = path or os.environ.get(SITE_ENV)
    if not named:
        return Site()
    try:
        return read_site(named)
    except ConfigError as e:
        if path is None and str(e).startswith(f"site file {named}: no such file"):
            raise ConfigError(f"${SITE_ENV} = {named}: no such file") from None
        raise

