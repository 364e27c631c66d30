"""The job script: one template for `gamma-titan submit` and `recipe run --launcher slurm`.

One SLURM task per node starts torchrun (gamma_titan.training.torchrun) with a c10d
rendezvous on the first node of the allocation, where the batch script itself runs. What the
script does, in order:

1. The site's #SBATCH lines, its setup lines and environment (site.py), then `cd` to the
   folder the job was submitted from, where the config's relative paths resolve.
2. `job.py start`: a line saying the job, the start and the time limit, and the record of the
   start in the run's `slurm/starts.jsonl`. It sizes the stop: SIGUSR1 to this script when
   the job's end time (read from `scontrol`, so `sbatch --time` and `scontrol update
   TimeLimit` are both followed) is the stop's time away, at most half the limit.
3. The rendezvous: the head node's address (SLURM's NodeAddr, a non-loopback one) and a free
   port below the kernel's ephemeral range, found there (`job.py rendezvous`), and a
   rendezvous id of its own per attempt; both logged. The head node's torchrun hosts the
   store or fails (never joins another job's store on the same port); the others connect.
4. srun, in a session of its own (srun kills its tasks on a SIGTERM of its own; `scancel
   --full` signals the script's process group, which setsid leaves srun out of).
5. `job.py after-stop`: the verdict, one line, and the record of how the start ended; the
   script requeues the job (time limit, preemption), retries a start that failed before it
   trained (a bounded number of times), or lets the job end.

Signals: SIGUSR1 (the time limit) and SIGTERM (scancel --signal=TERM -b/--full, preemption,
scontrol requeue) reach this script, which forwards SIGTERM to the job's steps: every rank
finishes its step, checkpoints it and exits 0. After training has ended, a signal is SLURM
ending or requeueing the job, and is not forwarded.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from gamma_titan.slurm.site import Site
from gamma_titan.training.launch import TORCHRUN, shutdown_timeout
from gamma_titan.training.torchrun import RDZV_HOST_ENV

#: Each log line's prefix: srun's --label gives the node ("1: "), torchrun this (the global
#: and the local rank of the worker that wrote it).
LOG_PREFIX = "[${role_name}${rank}|local${local_rank}]:"
#: What the job script runs inside the job (gamma_titan/slurm/job.py).
JOB_HELPER = "gamma_titan.slurm.job"


@dataclass
class JobSpec:
    """One run as a SLURM job."""

    name: str  # SLURM's job name
    run_dir: Path  # the run's dump folder (absolute)
    train_argv: list[str]  # gamma_titan.train's arguments
    nodes: int
    ranks_per_node: int
    gpus_per_node: int  # 0: CPU nodes (no GPU asked for)
    grace_seconds: float  # gamma.reliability.stop_grace_seconds: the stop's step and save
    script: Path  # where the script is written
    log: Path  # its log (%j: the job id), appended across requeues
    workdir: Path  # where the job runs: relative paths in the config resolve here
    launch_command: str  # what resumes it, for the run's last lines
    about: list[str] = field(default_factory=list)  # header comment lines


def _q(value: str | Path) -> str:
    return shlex.quote(str(value))


def job_script(job: JobSpec, site: Site) -> str:
    """The text of the job script of `job` on `site`."""
    sbatch = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node:
        sbatch.append(f"--gpus-per-node={job.gpus_per_node}")
    sbatch += ["--requeue", f"--output={job.log}", "--open-mode=append", *site.sbatch_lines()]
    setup = "".join(f"{line}\n" for line in site.setup)
    env = "".join(f"export {name}={_q(value)}\n" for name, value in site.env)
    python = site.nodes_python()
    container = " ".join(_q(o) for o in site.container.srun_options())
    prefix = site.container.prefix or ""
    # how this script runs the nodes' Python on its own node: inside the container
    if site.container.image:
        here = f'(srun --overlap --nodes=1 --ntasks=1 -w "$SLURMD_NODENAME" {container})'
    else:
        here = f"({prefix})"
    train = " ".join(_q(a) for a in ["-m", "gamma_titan.train", *job.train_argv])
    about = "".join(f"# {line}\n" for line in job.about)
    header = "".join(f"#SBATCH {line}\n" for line in sbatch)
    return f"""#!/bin/bash
{about}# Stop for good: scancel --signal=TERM JOBID (a checkpoint, then COMPLETED). Where it stands:
# gamma-titan status {_q(job.run_dir)}. Written by gamma-titan (gamma_titan/slurm/script.py).
{header}set -uo pipefail
cd {_q(job.workdir)}
{setup}{env}PYTHON={_q(python)}
RUN_DIR={_q(job.run_dir)}
here={here}  # this node's {python}{' in the container' if container or prefix else ''}
export GAMMA_TITAN_LAUNCH_COMMAND={_q(job.launch_command)}
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE={_q(LOG_PREFIX)}
export {RDZV_HOST_ENV}="$SLURMD_NODENAME"  # the store's host: this node, the allocation's first (torchrun.py)
# torchrun waits this long for its workers' stop before SIGKILL (a torchrun that reads it: torch >= 2.13)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown_timeout(job.grace_seconds)}
mkdir -p "$RUN_DIR/slurm"
helper() {{ ${{here[@]+"${{here[@]}}"}} "$PYTHON" -m {JOB_HELPER} "$@"; }}
threads=$(( ${{SLURM_CPUS_PER_TASK:-${{SLURM_CPUS_ON_NODE:-1}}}} / {job.ranks_per_node} ))
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}}  # the node's CPUs over its ranks

phase=starting  # starting, training, ended
stop=none
forwarding=
forward() {{  # $1: the signal this script got; the training gets SIGTERM (srun must not)
    [ "$phase" = ended ] && return 0  # SLURM ending or requeueing the job once training is over
    [ "$stop" = none ] || return 0  # said and forwarded once
    stop=$1
    echo "gamma-titan: job $SLURM_JOB_ID: $1 to the job script: every rank checkpoints its step"
    # in the background: while SLURM requeues or cancels the job, scancel retries ("try again later")
    # until KillWait is over, and this script must go on to its verdict meanwhile (the step's end
    # stops it: it must not reach the next start)
    [ "$phase" = training ] && {{ scancel --signal=TERM "$SLURM_JOB_ID" & forwarding=$!; }}
    return 0
}}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

stop_before_time_limit() {{  # SIGUSR1 to this script $1 s before the job's end time (re-read: it may move)
    trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    local end left
    while :; do
        end=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* EndTime=\\([^ ]*\\).*/\\1/p')
        end=$(date -d "$end" +%s 2>/dev/null) || return 0  # no time limit
        left=$(( end - $1 - $(date +%s) ))
        [ "$left" -le 0 ] && break
        sleep "$left" & nap=$!
        wait "$nap"
    done
    kill -USR1 $$
}}

nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
offset=$(GAMMA_TITAN_JOB="$(scontrol show job "$SLURM_JOB_ID")" helper start "$RUN_DIR" {job.grace_seconds:g}) || {{
    echo "gamma-titan: job $SLURM_JOB_ID: $PYTHON -m {JOB_HELPER} did not run on $(hostname -s): the nodes need gamma-titan's Python (the site file's python, setup or container)"
    exit 1
}}
timer=
if [ -n "$offset" ] && [ "$offset" != none ]; then
    stop_before_time_limit "$offset" &
    timer=$!
fi
node_addr() {{ scontrol show node "$1" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p'; }}
head="$SLURMD_NODENAME"  # this script's node, the allocation's first: it hosts the rendezvous
other=
for node in "${{nodes[@]}}"; do [ "$node" != "$head" ] && {{ other=$(node_addr "$node"); break; }}; done

attempt=1
code=0
while [ "$stop" = none ]; do
    read -r rdzv_addr rdzv_port < <(helper rendezvous "$(node_addr "$head")" "$other")
    rdzv_id="$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.$attempt.$RANDOM"  # no other job's agents can join it
    echo "gamma-titan: job $SLURM_JOB_ID: rendezvous $rdzv_id at ${{rdzv_addr:-?}}:${{rdzv_port:-?}} (head node $head)"
    [ "$stop" = none ] || break
    phase=training
    setsid srun --kill-on-bad-exit=1 --label --cpus-per-task="${{SLURM_CPUS_PER_TASK:-${{SLURM_CPUS_ON_NODE:-1}}}}" \\
        {container + " " if container else ""}{prefix + " " if prefix else ""}"$PYTHON" -m {TORCHRUN} \\
        --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node={job.ranks_per_node} \\
        --rdzv_id="$rdzv_id" --rdzv_backend=c10d --rdzv_endpoint="$rdzv_addr:$rdzv_port" \\
        --local-ranks-filter=0 --role=rank --tee=3 \\
        {train} &
    srun_pid=$!
    while ! wait "$srun_pid" && kill -0 "$srun_pid" 2>/dev/null; do :; done  # a trapped signal ends `wait` early
    wait "$srun_pid"
    code=$?
    phase=ended
    [ -n "$forwarding" ] && kill "$forwarding" 2>/dev/null
    verdict=$(GAMMA_TITAN_JOB="$(scontrol show job "$SLURM_JOB_ID")" helper after-stop "$RUN_DIR" "$stop" "$code" "$attempt")
    [ "$verdict" = retry ] || break
    verdict=
    phase=starting
    sleep $(( 5 * attempt )) & wait $!  # a transient fault's time to clear; a stop signal ends the wait
    attempt=$(( attempt + 1 ))
done
phase=ended
[ -n "$timer" ] && kill "$timer" 2>/dev/null
if [ "$stop" != none ] && [ "${{verdict:-}}" = "" ]; then  # stopped before training started
    verdict=$(GAMMA_TITAN_JOB="$(scontrol show job "$SLURM_JOB_ID")" helper after-stop "$RUN_DIR" "$stop" 0 "$attempt")
fi
if [ "${{verdict:-}}" = requeue ]; then
    scontrol requeue "$SLURM_JOB_ID" || {{ echo "gamma-titan: job $SLURM_JOB_ID: scontrol requeue failed; \\`sbatch\\` the script again to resume"; exit 1; }}
fi
exit "$code"
"""


def write_script(job: JobSpec, site: Site) -> Path:
    """The job script at job.script (its folder, which also takes the log, made first:
    SLURM opens the log before the script runs)."""
    job.script.parent.mkdir(parents=True, exist_ok=True)
    job.log.parent.mkdir(parents=True, exist_ok=True)
    tmp = job.script.with_name(f".{job.script.name}.tmp")
    tmp.write_text(job_script(job, site), encoding="utf-8")
    tmp.chmod(0o755)
    tmp.replace(job.script)
    return job.script
