"""Inside a recipe's SLURM job, once training has ended: requeue the job or let it end.

    python -m gamma_titan.recipes.slurm_job after-stop RUN_DIR STEPS SIGNAL CODE

SIGNAL is what reached the batch script (USR1: the time limit is near, TERM, or "none"),
CODE the exit code of the training step (srun). The job asks SLURM what happened to it
(`scontrol show job`) and decides, printing one line:

  finished            the run reached STEPS: the job ends COMPLETED
  cancelled           `scancel JOBID` (or SLURM ending it otherwise): it stays stopped
  requeued by SLURM   `scontrol requeue JOBID`: SLURM requeues it itself
  requeue             the time limit (USR1) or a preemption (PreemptTime set), the run not
                      finished and its exit code resumable: `scontrol requeue` of itself,
                      and the next start resumes from the stop's checkpoint
  stopped             any other stop (`scancel --signal=TERM`, with -b or --full too):
                      it stays stopped, COMPLETED with the training's exit code

SLURM itself records a job that ends within a preemption's GraceTime as ended, not
requeued, and never requeues a job that reached its time limit: hence this step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: Exit codes after which a restart would do the same again: bad input, a non-finite
#: loss, a full disk (gamma_titan/errors.py).
NOT_RESUMABLE = (2, 3, 4)


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` of `job_id` as key -> value ({} when it cannot be read)."""
    done = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}


def decide(fields: dict[str, str], restarts_at_start: int, signal: str, code: int, finished: bool) -> str:
    """One of: finished, cancelled, requeued by SLURM, requeue, stopped, failed."""
    state = fields.get("JobState", "")
    if int(fields.get("Restarts", "0") or 0) > restarts_at_start or state in ("REQUEUED", "REQUEUE_HOLD"):
        return "requeued by SLURM"
    if state in ("CANCELLED", "COMPLETING"):  # while this script runs, only SLURM's own end makes it COMPLETING
        return "cancelled"
    if finished:
        return "finished"
    preempted = fields.get("PreemptTime", "None") not in ("None", "Unknown", "")
    if (signal == "USR1" or preempted) and code not in NOT_RESUMABLE:
        return "requeue"
    return "stopped" if code == 0 else "failed"


def after_stop(run_dir: Path, steps: int, signal: str, code: int) -> int:
    from gamma_titan.recipes.local import is_finished

    job = os.environ["SLURM_JOB_ID"]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    fields = job_fields(job)
    verdict = decide(fields, restarts, signal, code, is_finished(run_dir, steps))
    why = {"USR1": "the time limit is near", "TERM": "SIGTERM", "none": "no signal to the job script"}.get(signal, signal)
    if verdict == "requeue":
        reason = "preempted" if fields.get("PreemptTime", "None") not in ("None", "Unknown", "") else why
        # said first: the requeue ends this job script, and this process with it, at once
        print(f"gamma-titan: job {job}: {reason}, training stopped with exit {code}: requeueing it; its next "
              f"start resumes from the stop's checkpoint", flush=True)
        requeued = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if requeued.returncode != 0:
            print(f"gamma-titan: job {job}: scontrol requeue failed: {requeued.stderr.strip()}; `sbatch` the "
                  f"script again to resume", flush=True)
            return 1
        return 0
    lines = {
        "finished": f"finished: {run_dir} reached step {steps}",
        "cancelled": "cancelled (scancel): stays stopped; `sbatch` the script again to resume",
        "requeued by SLURM": "requeued by SLURM (scontrol requeue): its next start resumes",
        "stopped": f"stopped ({why}), exit {code}: stays stopped; `sbatch` the script again to resume",
        "failed": f"training ended with exit {code} ({why}): not requeued",
    }
    print(f"gamma-titan: job {job}: {lines[verdict]}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 5 or argv[0] != "after-stop":
        print("usage: python -m gamma_titan.recipes.slurm_job after-stop RUN_DIR STEPS SIGNAL CODE", file=sys.stderr)
        return 2
    _, run_dir, steps, signal, code = argv
    return after_stop(Path(run_dir), int(steps), signal, int(code))


if __name__ == "__main__":
    sys.exit(main())
