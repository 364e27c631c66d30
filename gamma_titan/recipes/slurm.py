"""sbatch scripts for a recipe's runs: one job per run, torchrun on every node.

Each job starts one torchrun per node (srun, one task per node) with a c10d rendezvous on
the first node of the allocation; nodes and GPUs per node come from the run. SLURM's time
limit sends SIGTERM early (`--signal`), which the trainer turns into a checkpoint and a
clean exit (gamma.reliability.stop_grace_seconds, sized by the plan to cover the run's
estimated save time), torchrun waits for it (`--shutdown-timeout`), and a resubmitted job
resumes from it (gamma_titan/training/launch.py). Scripts go to OUT/slurm/, and the job's log next to the run's metrics.
"""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from gamma_titan.errors import ConfigError
from gamma_titan.training.launch import save_seconds, shutdown_flags, shutdown_timeout, shutdown_warning
from gamma_titan.recipes.plan import PlannedRun
from gamma_titan.recipes.spec import PROJECT_ROOT, Scale

RDZV_PORT = 29500


def _time_limit(run: PlannedRun, scale: Scale) -> str:
    """1.5 × the GPU-hours estimate spread over the job's GPUs, at least an hour."""
    hours = scale.time_limit_hours or max(1.0, 1.5 * run.gpu_hours / run.world_size)
    minutes = math.ceil(hours * 60)
    return f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"


def sbatch_script(run: PlannedRun, scale: Scale, run_dir: Path, recipe: str) -> str:
    train = " ".join(shlex.quote(a) for a in ["-m", "gamma_titan.train", *run.argv(run_dir)])
    flags = "".join(f"    {flag} \\\n" for flag in shutdown_flags(run.stop_grace_seconds))
    warning = shutdown_warning(run.stop_grace_seconds)
    warning = f"# {warning}\n" if warning else ""
    return f"""#!/bin/bash
# gamma-titan recipe {recipe}, scale {scale.name}, run {run.name}: {run.steps} steps,
# {run.tokens / 1e9:.4g}B tokens, ≈ {run.gpu_hours:.4g} GPU-hours. Written by `gamma-titan recipe run`.
# Stop: SIGTERM {shutdown_timeout(run.stop_grace_seconds)} s before the time limit; the trainer finishes its step and
# saves (≈ {save_seconds(run.params, run.nodes):.0f} s estimated) within {run.stop_grace_seconds:g} s; torchrun waits as long.
{warning}#SBATCH --job-name=gt-{recipe}-{run.name}
#SBATCH --nodes={run.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={run.gpus_per_node}
#SBATCH --exclusive
#SBATCH --time={_time_limit(run, scale)}
#SBATCH --signal=TERM@{shutdown_timeout(run.stop_grace_seconds)}
#SBATCH --output={run_dir}/slurm-%j.out
#SBATCH --open-mode=append
set -euo pipefail

PYTHON=${{PYTHON:-{sys.executable}}}
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head_node=${{nodes[0]}}
head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{{print $1}}')
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}
export GAMMA_TITAN_LAUNCH_COMMAND="sbatch $0"
cd {shlex.quote(str(PROJECT_ROOT))}
mkdir -p {shlex.quote(str(run_dir))}

srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \\
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node={run.gpus_per_node} \\
{flags}    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node_ip:{RDZV_PORT}" \\
    --local-ranks-filter=0 --role=rank --tee=3 \\
    {train}
"""


def write_scripts(runs: list[PlannedRun], scale: Scale, out: Path, recipe: str) -> dict[str, Path]:
    folder = out / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {}
    for run in runs:
        path = folder / f"{run.name}.sbatch"
        path.write_text(sbatch_script(run, scale, (out / run.name).resolve(), recipe), encoding="utf-8")
        path.chmod(0o755)
        scripts[run.name] = path
    return scripts


def check_sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("--launcher slurm: no sbatch on PATH (use --dry-run to only write the scripts)")
    return sbatch


def submit(scripts: dict[str, Path], sbatch: str) -> dict[str, str]:
    """sbatch each script; run name -> job id (or the error)."""
    jobs = {}
    for name, path in scripts.items():
        (path.parent.parent / name).mkdir(exist_ok=True)  # SLURM opens --output before the script runs
        done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
        if done.returncode == 0:
            jobs[name] = done.stdout.strip().split(";")[0]
            print(f"  {name}: submitted job {jobs[name]}", flush=True)
        else:
            jobs[name] = f"failed: {done.stderr.strip() or done.returncode}"
            print(f"  {name}: sbatch FAILED: {done.stderr.strip()}", flush=True)
    return jobs
