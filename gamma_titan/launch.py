"""The torchrun command line that trains a config on this node (`gamma-titan train`, recipes)."""

from __future__ import annotations

import os
import sys

from gamma_titan.run_record import LAUNCH_COMMAND_ENV


def torchrun_command(nproc: int, argv: list[str], threads: int | None = None) -> tuple[list[str], dict[str, str]]:
    """torchrun with `nproc` ranks running `gamma_titan.train argv`, and its environment:
    the user's command for the run record, and the CPU threads split between the ranks
    (or `threads` each)."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={nproc}",
        "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
        "-m", "gamma_titan.train", *argv,
    ]
    env = {**os.environ, LAUNCH_COMMAND_ENV: " ".join(["gamma-titan", *sys.argv[1:]])}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    elif nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return command, env
