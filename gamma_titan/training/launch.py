"""How a run is launched: the torchrun command line (`gamma-titan train`, recipes, SLURM),
and how long a stop may take.

A preempted or timed-out job gets SIGTERM; torchrun forwards it to its workers, which
finish the step in progress, checkpoint it and exit (`gamma.reliability.
stop_grace_seconds`, gamma_titan/training/graceful_stop.py). torchrun SIGKILLs the workers
`--shutdown-timeout` seconds after forwarding (30 by default), and a 7B or 16B save takes
minutes: every launch we generate gives torchrun the grace period plus a margin, and a
cluster job's grace period is sized from its checkpoint (state size / write bandwidth).
"""

from __future__ import annotations

import math
import os
import sys

from gamma_titan.training.run_record import LAUNCH_COMMAND_ENV

#: torchrun, with exit codes a scheduler can read (0 after a clean stop): torchrun.py.
TORCHRUN = "gamma_titan.training.torchrun"
#: torchrun waits this long beyond the trainer's grace period before it SIGKILLs the
#: workers, so the trainer's own watchdog (exit 143, last checkpoint intact) acts first.
SHUTDOWN_MARGIN_SECONDS = 60
#: A full checkpoint per parameter: fp32 weights and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 12
#: The write bandwidth a cluster job's stop time assumes per node: a conservative share of
#: a parallel file system under load (every rank writes its own shard).
WRITE_BYTES_PER_SECOND_PER_NODE = 1e9
#: What a save costs beyond its bytes: DCP's save plan, its metadata and the barriers
#: (measured: 0.5 s for the 5M-parameter debug model on a CPU, where the bytes take 0.06 s).
SAVE_OVERHEAD_SECONDS = 5.0


def save_seconds(params: int, nodes: int) -> float:
    """Estimated time to write one full checkpoint of a `params`-parameter model."""
    return SAVE_OVERHEAD_SECONDS + params * CHECKPOINT_BYTES_PER_PARAM / (nodes * WRITE_BYTES_PER_SECOND_PER_NODE)


#: A save's collectives wait this many times its estimated length before they give up: a
#: shared file system under load writes several times slower than the estimate assumes.
SAVE_TIMEOUT_FACTOR = 4


def save_timeout_seconds(params: int, nodes: int, grace_seconds: float, init_timeout_seconds: float) -> int:
    """How long a checkpoint save's collectives may wait for the slowest writer (TorchTitan
    shortens every process group's timeout to comm.train_timeout_seconds after step 1, 100 s
    by default, while a 16B save takes minutes): SAVE_TIMEOUT_FACTOR x the estimate, never
    less than the stop's grace period (a stop's save must fit in it anyway) nor than the
    start-up timeout (comm.init_timeout_seconds, which the first saves have)."""
    return math.ceil(max(SAVE_TIMEOUT_FACTOR * save_seconds(params, nodes), grace_seconds, init_timeout_seconds))


def stop_grace_seconds(configured: float, params: int, nodes: int, step_seconds: float) -> int:
    """The grace period a run needs between SIGTERM and its exit: the step in progress plus
    a full save, with 50% headroom; never less than the configured one."""
    return math.ceil(max(configured, 1.5 * (step_seconds + save_seconds(params, nodes))))


def shutdown_timeout(grace_seconds: float) -> int:
    """torchrun's --shutdown-timeout for a run with this grace period."""
    return math.ceil(grace_seconds) + SHUTDOWN_MARGIN_SECONDS


#: Where torchrun has no --shutdown-timeout, it SIGKILLs its workers this long after it
#: forwards SIGTERM, whatever the run needs (torch/distributed/elastic/multiprocessing/api.py).
FIXED_SHUTDOWN_SECONDS = 30


def torchrun_takes_shutdown_timeout() -> bool:
    """Whether this torch's torchrun has --shutdown-timeout (pytorch#172596, merged 2026-03:
    torch 2.13 has it, 2.11 does not; measured on both wheels)."""
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in LaunchConfig.__dataclass_fields__


def shutdown_flags(grace_seconds: float) -> list[str]:
    """torchrun's flag for this grace period, where torchrun takes one."""
    return [f"--shutdown-timeout={shutdown_timeout(grace_seconds)}"] if torchrun_takes_shutdown_timeout() else []


def shutdown_warning(grace_seconds: float) -> str | None:
    """One line when this torch's torchrun would cut the grace period short."""
    if torchrun_takes_shutdown_timeout() or grace_seconds <= FIXED_SHUTDOWN_SECONDS:
        return None
    import torch

    return (f"warning: torch {torch.__version__}'s torchrun has no --shutdown-timeout: it SIGKILLs the workers "
            f"{FIXED_SHUTDOWN_SECONDS} s after forwarding SIGTERM, so a stop that needs longer than that "
            f"(gamma.reliability.stop_grace_seconds = {grace_seconds:g}) loses its checkpoint; torch 2.13 has the flag")


def launch_command() -> str:
    """The command the user typed, as the run record and the run's last lines give it."""
    return " ".join(["gamma-titan", *sys.argv[1:]])


#: What a torchrun launch tells each worker about its world. A trainer we launch is a world
#: of its own: inherited from an outer launch, these would make a world of one join that
#: world's store, and two runs of a recipe share one port.
WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                   "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def _environment(threads: int | None) -> dict[str, str]:
    """A launched trainer's environment: ours without an outer launch's world, the user's
    command for the run record, unbuffered output (a redirected log grows line by line), and
    `threads` CPU threads."""
    env = {k: v for k, v in os.environ.items() if k not in WORLD_VARIABLES}
    env.update({LAUNCH_COMMAND_ENV: launch_command(), "PYTHONUNBUFFERED": "1"})
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def train_command(nproc: int, argv: list[str], grace_seconds: float,
                  threads: int | None = None) -> tuple[list[str], dict[str, str]]:
    """`torchrun_command` for several ranks; one rank is `python -m gamma_titan.train argv`
    itself (a world of one, the same environment, without torchrun's own start-up)."""
    if nproc > 1:
        return torchrun_command(nproc, argv, grace_seconds, threads)
    return [sys.executable, "-m", "gamma_titan.train", *argv], _environment(threads)


def torchrun_command(nproc: int, argv: list[str], grace_seconds: float,
                     threads: int | None = None) -> tuple[list[str], dict[str, str]]:
    """torchrun with `nproc` ranks running `gamma_titan.train argv`, and its environment:
    the user's command for the run record, and the CPU threads split between the ranks
    (or `threads` each). `grace_seconds`: the run's gamma.reliability.stop_grace_seconds."""
    command = [
        sys.executable, "-u", "-m", TORCHRUN,  # -u: a redirected log grows line by line
        "--standalone", f"--nproc_per_node={nproc}", *shutdown_flags(grace_seconds),
        "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
        "-m", "gamma_titan.train", *argv,
    ]
    env = _environment(threads)
    if sys.stdout.isatty():  # the workers write to torchrun's pipe: tell them a terminal reads it
        env.setdefault("FORCE_COLOR", "1")
    if not threads and nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return command, env
