"""`gamma-titan status RUN_DIR`: where a run stands, or every run of a recipe's OUT.

Per run: its SLURM job and the job's state (squeue / scontrol; "not queued" once SLURM is
done with it, and the records alone where there is no SLURM), the step and the target, the
newest complete checkpoint, every start and how it ended, as the job recorded it
(records.py: SLURM's own records cannot tell a time limit from a preemption or an
administrator's requeue), and the ETA.
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from gamma_titan.errors import ConfigError
from gamma_titan.files import METRICS_FILE, RECIPE_PLAN_FILE
from gamma_titan.slurm import records, scheduler

#: How each verdict of a start's end reads (job.py's VERDICTS).
ENDS = {
    "finished": "finished",
    "requeue": "{why}: checkpointed, requeued itself",
    "requeued by SLURM": "an administrator's requeue (scontrol requeue): checkpointed, requeued by SLURM",
    "cancelled": "cancelled (scancel)",
    "stopped": "stopped ({why}): stays stopped",
    "retry": "failed before it trained (exit {code}): started again",
    "failed": "failed (exit {code})",
}
#: SLURM states after which a job will not run again.
OVER = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED")


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    return (f"{days}d " if days else "") + f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def _when(iso: str | None) -> str:
    try:
        return datetime.datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError):
        return "?"


def job_line(run_dir: Path) -> tuple[str, str | None]:
    """The SLURM line of a run, and its job's state while it is live (pending, running)."""
    submitted = [r["job"] for r in records.jobs(run_dir) if r.get("job")]
    started = [r["job"] for r in records.starts(run_dir) if r.get("job")]
    known = submitted + [j for j in started if j not in submitted]  # a script submitted by hand: its starts
    if not known:
        return "SLURM: no job (never submitted with gamma-titan submit or recipe run --launcher slurm)", None
    job = known[-1]
    if shutil.which("scontrol") is None:
        return f"SLURM: job {job} (its state unknown: no scontrol here)", None
    fields = scheduler.job_fields(job)
    state = fields.get("JobState")
    if not state:
        return f"SLURM: not queued (job {job} is over; SLURM no longer lists it)", None
    if state in OVER:
        return f"SLURM: not queued (job {job}: {state})", None
    where = f" on {fields['NodeList']}" if state == "RUNNING" and fields.get("NodeList") not in (None, "(null)") else ""
    reason = f" ({fields['Reason']})" if state == "PENDING" and fields.get("Reason") not in (None, "None") else ""
    since = f", running {fields['RunTime']}" if state == "RUNNING" and fields.get("RunTime") else ""
    restarts = int(fields.get("Restarts", "0") or 0)
    return f"SLURM: job {job} {state}{where}{reason}{since} (start {restarts + 1})", state


def start_lines(run_dir: Path, live: bool) -> list[str]:
    """One line per start: when, where, from which step, how it ended."""
    events = records.starts(run_dir)
    begins = [e for e in events if e.get("event") == "start"]
    lines = []
    for i, begin in enumerate(begins):
        ends = [e for e in events if e.get("event") == "end" and e.get("job") == begin.get("job")
                and e.get("start") == begin.get("start")]
        ends = [e for e in ends if e.get("time", "") >= begin.get("time", "")]
        frm = f"from step {begin['checkpoint']}" if begin.get("checkpoint") else "from the start"
        head = (f"    {i + 1}. job {begin.get('job')} start {begin.get('start')}, {_when(begin.get('time'))}, "
                f"{begin.get('nodes')}, {frm}")
        retries = [e for e in ends if e.get("verdict") == "retry"]
        final = next((e for e in ends if e.get("verdict") != "retry"), None)
        note = f" ({len(retries)} failed attempt(s) retried)" if retries else ""
        if final is None:
            is_last = i == len(begins) - 1
            how = "running" if live and is_last else "ended without a record (killed, or its node lost)"
        else:
            how = ENDS.get(final.get("verdict"), final.get("verdict", "?")).format(
                why=final.get("why", "?"), code=final.get("code", "?"))
            how += f" at step {final['checkpoint']}" if final.get("checkpoint") and final.get("verdict") != "finished" \
                else f" at step {final.get('step')}" if final.get("verdict") == "finished" else ""
        lines.append(f"{head}: {how}{note}")
    return lines


def run_status(run_dir: Path) -> list[str]:
    job, state = job_line(run_dir)
    live = state is not None
    now = records.progress(run_dir)
    if now.step is None:
        step = "step: none logged yet" + (f" (target {now.target})" if now.target else "")
    else:
        share = f" ({100 * now.step / now.target:.0f}%)" if now.target else ""
        step = f"step {now.step} / {now.target if now.target else '?'}{share}"
    if now.target and now.step is not None and now.step >= now.target:
        eta = "done"
    elif state == "RUNNING" and now.eta_s is not None:
        eta = f"ETA {duration(now.eta_s)}"
    elif now.target and now.step_seconds:
        left = now.target - (now.step or 0)
        eta = (f"{'pending' if live else 'not running'}: {left} steps left ≈ {duration(left * now.step_seconds)} "
               "of training")
    else:
        eta = "ETA unknown"
    ckpt = f"checkpoint: step {now.checkpoint}" if now.checkpoint else "checkpoint: none complete"
    lines = [str(run_dir), f"  {job}", f"  {step}, {eta}", f"  {ckpt}"]
    starts = start_lines(run_dir, live)
    if starts:
        lines += ["  starts:"] + starts
    return lines


def status(path: str) -> int:
    root = Path(path).resolve()
    if not root.is_dir():
        raise ConfigError(f"{path}: no such folder (a run's dump folder, or a recipe's --out)")
    plan = root / RECIPE_PLAN_FILE
    if plan.is_file():
        from gamma_titan.file_reads import read_json
        from gamma_titan.files import RECIPE_RECORD_HINT

        record = read_json(plan, RECIPE_RECORD_HINT, keys=("runs",))
        names = [r.get("name") for r in record["runs"] if isinstance(r, dict) and r.get("name")]
        print(f"{root}: recipe {record.get('recipe')}, {len(names)} runs")
        for name in names:
            print("\n".join(run_status(root / name)))
        return 0
    if not (root / METRICS_FILE).exists() and not (root / records.SLURM_FOLDER).is_dir() and \
            not (root / "runs").is_dir():
        raise ConfigError(f"{path}: neither a run's dump folder (metrics.jsonl, runs/, slurm/) nor a recipe's --out "
                          f"({RECIPE_PLAN_FILE})")
    print("\n".join(run_status(root)))
    return 0
