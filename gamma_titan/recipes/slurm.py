"""sbatch scripts for a recipe's runs: one job per run, torchrun on every node.

Each job starts one torchrun per node (srun, one task per node) with a c10d rendezvous on
the first node of the allocation; nodes and GPUs per node come from the run (a CPU scale
asks for no GPU). How the job ends (README "On a GPU cluster", the exit codes):

* The time limit: SLURM sends SIGUSR1 to the batch script `--signal` seconds before it
  (enough for the step in progress and a full save, gamma.reliability.stop_grace_seconds,
  and at most half the time limit); the script forwards SIGTERM to the training, which
  checkpoints its step and exits 0, and the job requeues itself (slurm_job.py).
* Preemption (PreemptMode=REQUEUE) and `scontrol requeue`: SLURM sends SIGTERM to the
  training itself; it checkpoints; the job is requeued (by itself after a preemption,
  which SLURM does not requeue when the job ends within its GraceTime).
* `scancel JOBID`: a checkpoint within SLURM's KillWait, then the job stays CANCELLED.
* `scancel --signal=TERM JOBID` (also with `-b` or `--full`): a checkpoint, and the job
  ends COMPLETED: stopped for good until the script is submitted again.

The batch script traps SIGTERM and SIGUSR1 and forwards SIGTERM to the job's steps: srun
answers a SIGTERM of its own by killing its tasks at once, so srun runs in a session of its
own, where `scancel --full` (which signals the batch script's process group) does not reach
it. torchrun is gamma_titan.training.torchrun (exit 0 after a clean stop, no traceback).
A resubmitted or requeued job resumes from the newest complete checkpoint. Scripts go to
OUT/slurm/NAME.sbatch, each job's log to OUT/slurm/NAME-JOBID.out (appended across
requeues), each line of it prefixed with the node (srun's task number) and the global and
local rank that wrote it: `1: [rank2|local0]: ...`.
"""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from gamma_titan.errors import ConfigError
from gamma_titan.training.launch import TORCHRUN, save_seconds, shutdown_flags, shutdown_timeout, shutdown_warning
from gamma_titan.recipes.plan import PlannedRun
from gamma_titan.recipes.spec import CPU_SCALES, PROJECT_ROOT, Scale

#: The c10d rendezvous port on the head node: this plus the job id modulo RDZV_PORT_SPAN, so
#: that two jobs sharing a node do not collide.
RDZV_PORT_BASE, RDZV_PORT_SPAN = 20000, 20000
#: Each log line's prefix: srun's --label gives the node ("1: "), torchrun this (the global
#: and the local rank of the worker that wrote it).
LOG_PREFIX = "[${role_name}${rank}|local${local_rank}]:"


def time_limit_minutes(run: PlannedRun, scale: Scale) -> int:
    """1.5 × the GPU-hours estimate spread over the job's GPUs, at least an hour."""
    hours = scale.time_limit_hours or max(1.0, 1.5 * run.gpu_hours / run.world_size)
    return math.ceil(hours * 60)


def signal_offset(run: PlannedRun, minutes: int) -> tuple[int, str | None]:
    """Seconds before the time limit that SLURM signals the job: what the stop needs
    (torchrun's shutdown timeout), at most half the time limit; and a warning when that
    cuts the stop short."""
    needed = shutdown_timeout(run.stop_grace_seconds)
    offset = min(needed, minutes * 60 // 2)
    if offset < needed:
        return offset, (f"warning: the time limit ({minutes} min) leaves {offset} s for the stop before it, which "
                        f"needs {needed} s (the step and a full save, gamma.reliability.stop_grace_seconds + "
                        f"{needed - math.ceil(run.stop_grace_seconds)} s): the job may be killed before its "
                        f"checkpoint is complete")
    return offset, None


def _slurm_time(minutes: int) -> str:
    return f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"


def sbatch_script(run: PlannedRun, scale: Scale, run_dir: Path, recipe: str, script: Path) -> str:
    train = " ".join(shlex.quote(a) for a in ["-m", "gamma_titan.train", *run.argv(run_dir)])
    flags = "".join(f"    {flag} \\\n" for flag in shutdown_flags(run.stop_grace_seconds))
    minutes = time_limit_minutes(run, scale)
    offset, short = signal_offset(run, minutes)
    warnings = [w for w in (shutdown_warning(run.stop_grace_seconds), short) if w]
    warnings = "".join(f"# {w}\n" for w in warnings)
    gpus = "" if scale.name in CPU_SCALES else f"#SBATCH --gpus-per-node={run.gpus_per_node}\n"
    log = script.with_name(f"{run.name}-%j.out")
    return f"""#!/bin/bash
# gamma-titan recipe {recipe}, scale {scale.name}, run {run.name}: {run.steps} steps,
# {run.tokens / 1e9:.4g}B tokens, ≈ {run.gpu_hours:.4g} GPU-hours. Written by `gamma-titan recipe run`.
# Stop: SIGUSR1 {offset} s before the time limit; the training finishes its step and saves
# (≈ {save_seconds(run.params, run.nodes):.0f} s estimated) within {run.stop_grace_seconds:g} s; the job requeues itself.
# `scancel --signal=TERM JOBID` stops it for good with a checkpoint (gamma_titan/recipes/slurm.py).
{warnings}#SBATCH --job-name=gt-{recipe}-{run.name}
#SBATCH --nodes={run.nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --exclusive
#SBATCH --time={_slurm_time(minutes)}
#SBATCH --signal=B:USR1@{offset}
#SBATCH --requeue
#SBATCH --output={log}
#SBATCH --open-mode=append
set -uo pipefail

PYTHON=${{PYTHON:-{sys.executable}}}
RUN_DIR={shlex.quote(str(run_dir))}
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head_node=${{nodes[0]}}
head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{{print $1}}')
threads=$(( ${{SLURM_CPUS_ON_NODE:-{run.gpus_per_node * 8}}} / {run.gpus_per_node} ))
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}}
export GAMMA_TITAN_LAUNCH_COMMAND={shlex.quote(f"sbatch {script}")}
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE={shlex.quote(LOG_PREFIX)}
cd {shlex.quote(str(PROJECT_ROOT))}
mkdir -p "$RUN_DIR"
echo "gamma-titan: job $SLURM_JOB_ID (start $(( ${{SLURM_RESTART_COUNT:-0}} + 1 ))) on $SLURM_JOB_NODELIST"

stop=none
forward() {{  # $1: the signal this script got; the training gets SIGTERM (srun must not)
    [ "$stop" = none ] && stop=$1
    echo "gamma-titan: job $SLURM_JOB_ID: $1 to the job script: every rank checkpoints its step"
    scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

setsid srun --kill-on-bad-exit=1 --label "$PYTHON" -m {TORCHRUN} \\
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node={run.gpus_per_node} \\
{flags}    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d \\
    --rdzv_endpoint="$head_node_ip:$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))" \\
    --local-ranks-filter=0 --role=rank --tee=3 \\
    {train} &
srun_pid=$!
while ! wait "$srun_pid" && kill -0 "$srun_pid" 2>/dev/null; do :; done  # a trapped signal ends `wait` early
wait "$srun_pid"
code=$?
"$PYTHON" -m gamma_titan.recipes.slurm_job after-stop "$RUN_DIR" {run.steps} "$stop" "$code"
exit "$code"
"""


def write_scripts(runs: list[PlannedRun], scale: Scale, out: Path, recipe: str) -> dict[str, Path]:
    folder = (out / "slurm").resolve()
    folder.mkdir(parents=True, exist_ok=True)  # also the jobs' logs: SLURM opens them before the script runs
    scripts = {}
    for run in runs:
        path = folder / f"{run.name}.sbatch"
        path.write_text(sbatch_script(run, scale, (out / run.name).resolve(), recipe, path), encoding="utf-8")
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
        done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
        if done.returncode == 0:
            jobs[name] = done.stdout.strip().split(";")[0]
            print(f"  {name}: submitted job {jobs[name]}", flush=True)
        else:
            jobs[name] = f"failed: {done.stderr.strip() or done.returncode}"
            print(f"  {name}: sbatch FAILED: {done.stderr.strip()}", flush=True)
    return jobs
