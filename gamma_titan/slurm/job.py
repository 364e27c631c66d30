"""Inside a SLURM job: the steps the job script (script.py) runs around training.

    python -m gamma_titan.slurm.job start RUN_DIR GRACE_SECONDS
    python -m gamma_titan.slurm.job rendezvous HEAD_NODE_ADDR [OTHER_NODE_ADDR]
    python -m gamma_titan.slurm.job after-stop RUN_DIR SIGNAL CODE ATTEMPT

The job's `scontrol show job` comes in $GAMMA_TITAN_JOB (the script asks SLURM, so that these
steps run wherever the nodes' Python does: in a container without SLURM's commands too).
What the script acts on goes to stdout, one word; what the log says goes to stderr.

start       the start line (job, start, nodes, time limit, when the stop begins), the start's
            record (records.py); prints the seconds before the end time at which the script
            signals itself (SIGUSR1), or "none" without a time limit: what the stop needs
            (torchrun's shutdown timeout: the grace period + 60 s), at most half the limit.
rendezvous  on the head node: its address and a free port below the kernel's ephemeral range
            (which the script hands to torchrun, whose head hosts the store there or fails).
after-stop  the verdict, one line, and the end's record:
              finished            the run reached training.steps: the job ends COMPLETED
              cancelled           scancel JOBID (or SLURM ending it): it stays stopped
              requeued by SLURM   scontrol requeue JOBID: SLURM starts it again
              requeue             the time limit (SIGUSR1) or a preemption, the run not finished
                                  and its exit resumable: the script requeues the job
              retry               the start failed before it trained (a rendezvous, a node that
                                  cannot reach the store): tried again, MAX_ATTEMPTS in all
              stopped             any other stop (scancel --signal=TERM): it stays stopped
              failed              training failed: the job ends with its exit code

SLURM itself records a job that ends within a preemption's GraceTime as ended, not requeued,
and never requeues a job that reached its time limit: hence the script's own requeue.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import random
import re
import socket
import sys
from pathlib import Path

from gamma_titan.slurm import records
from gamma_titan.slurm.site import time_minutes
from gamma_titan.training.launch import shutdown_timeout, shutdown_warning

#: Where the job script passes `scontrol show job`.
JOB_FIELDS_ENV = "GAMMA_TITAN_JOB"
#: Exit codes after which a restart would do the same again: bad input, a non-finite
#: loss, a full disk (gamma_titan/errors.py).
NOT_RESUMABLE = (2, 3, 4)
#: Attempts of one start that fails before it trains (each a new rendezvous).
MAX_ATTEMPTS = 3
#: The rendezvous port is looked for from here up to the kernel's ephemeral range (whose ports
#: an outgoing connection may hold at any time, and a store then cannot listen on).
RDZV_PORT_LOW = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
VERDICTS = ("finished", "cancelled", "requeued by SLURM", "requeue", "retry", "stopped", "failed")


def say(line: str) -> None:
    print(f"gamma-titan: job {os.environ.get('SLURM_JOB_ID', '?')}: {line}", file=sys.stderr, flush=True)


def job_fields(text: str | None = None) -> dict[str, str]:
    """`scontrol show job`'s key=value pairs (from $GAMMA_TITAN_JOB by default)."""
    text = os.environ.get(JOB_FIELDS_ENV, "") if text is None else text
    return dict(re.findall(r"(\w+)=(\S*)", text))


def restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def _clock(minutes: float) -> str:
    seconds = round(minutes * 60)
    days, rest = divmod(seconds, 86400)
    return (f"{days}-" if days else "") + f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


# --- start --------------------------------------------------------------------------------

def stop_offset(limit_minutes: float | None, grace_seconds: float) -> tuple[int | None, str | None]:
    """Seconds before the end time at which the job stops its training (None: no time
    limit), and a warning when the limit leaves the stop less than it needs."""
    if limit_minutes is None:
        return None, None
    needed = shutdown_timeout(grace_seconds)
    offset = min(needed, int(limit_minutes * 60 // 2))
    if offset < needed:
        return offset, (f"warning: the time limit ({_clock(limit_minutes)}) leaves {offset} s for the stop before it, "
                        f"which needs {needed} s (the step and a full save, gamma.reliability.stop_grace_seconds = "
                        f"{grace_seconds:g}, + {needed - math.ceil(grace_seconds)} s): the checkpoint may not complete")
    return offset, None


def start(run_dir: Path, grace_seconds: float, fields: dict[str, str]) -> str:
    restart = restart_count()
    limit_text = fields.get("TimeLimit", "UNLIMITED")
    try:
        limit = time_minutes(limit_text)
    except ValueError:
        limit = None
    offset, short = stop_offset(limit, grace_seconds)
    at = records.progress(run_dir)
    nodes = os.environ.get("SLURM_JOB_NODELIST", "?")
    begins = (f"from step {at.checkpoint}" if at.checkpoint else "from the start")
    limit_line = ("no time limit" if offset is None else
                  f"time limit {_clock(limit)}, the stop begins {offset} s before it")
    print(f"gamma-titan: job {os.environ.get('SLURM_JOB_ID', '?')} (start {restart + 1}) on {nodes}: "
          f"{begins}; {limit_line}", file=sys.stderr, flush=True)
    for warning in (short, shutdown_warning(grace_seconds)):
        if warning:
            say(warning)
    records.append_line(run_dir / records.SLURM_FOLDER / records.STARTS_FILE, {
        "event": "start", "job": os.environ.get("SLURM_JOB_ID"), "start": restart + 1, "time": records.now_iso(),
        "nodes": nodes, "host": socket.gethostname(), "step": at.step, "checkpoint": at.checkpoint,
        "target": at.target, "time_limit_s": None if limit is None else round(limit * 60),
        "stop_offset_s": offset})
    return "none" if offset is None else str(offset)


# --- rendezvous -----------------------------------------------------------------------------

def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def head_address(node_addr: str, other_addr: str | None) -> str:
    """The address the other nodes reach this (head) node at: SLURM's NodeAddr where it is an
    address; else that name resolved, a non-loopback address first (a hosts file may map the
    host name to 127.0.1.1); failing that, this node's address on the route to another node."""
    try:
        ipaddress.ip_address(node_addr)
        return node_addr
    except ValueError:
        pass
    try:
        found = [info[4][0] for info in socket.getaddrinfo(node_addr, None, socket.AF_INET, socket.SOCK_STREAM)]
    except OSError:
        found = []
    outside = [a for a in found if not _is_loopback(a)]
    if outside:
        return outside[0]
    if other_addr:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet: only the route is looked up
                s.connect((other_addr, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return found[0] if found else node_addr


def ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_free(port: int) -> bool:
    """Nothing listens on (or holds) `port` on any address: a store could listen there."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
        except OSError as e:
            if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL) and family == socket.AF_INET6:
                continue  # no IPv6 here
            return False
    return True


def free_port(low: int = RDZV_PORT_LOW, high: int | None = None) -> int:
    """A port nothing holds on this node, in [low, the ephemeral range), looked for from a
    random place: two jobs starting on one node at the same moment (each checking before
    the other binds) rarely pick the same one, and when they do, the head's torchrun fails to
    host its store (it hosts it or fails: training/torchrun.py) and the start is tried again."""
    high = ephemeral_low() if high is None else high
    if high - low < 16:
        low, high = 1024, high  # a site that moved its ephemeral range down: whatever is below it
    span = high - low
    first = random.SystemRandom().randrange(span)
    for i in range(span):
        port = low + (first + i) % span
        if _port_free(port):
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on {socket.gethostname()}")


def rendezvous(node_addr: str, other_addr: str | None) -> str:
    return f"{head_address(node_addr, other_addr)} {free_port()}"


# --- after-stop -----------------------------------------------------------------------------

def decide(fields: dict[str, str], restart_at_start: int, signal: str, code: int, finished: bool,
           trained: bool, attempt: int) -> str:
    """The verdict (one of VERDICTS) once training has ended."""
    state = fields.get("JobState", "")
    if int(fields.get("Restarts", "0") or 0) > restart_at_start or state.startswith("REQUEUE"):
        return "requeued by SLURM"
    if state in ("CANCELLED", "COMPLETING"):  # while this script runs, only SLURM's own end makes it COMPLETING
        return "cancelled"
    if finished:
        return "finished"
    if (signal == "USR1" or preempted(fields)) and code not in NOT_RESUMABLE:
        return "requeue"
    if signal == "none" and code != 0 and code not in NOT_RESUMABLE and not trained and attempt < MAX_ATTEMPTS:
        return "retry"
    return "stopped" if code == 0 else "failed"


def preempted(fields: dict[str, str]) -> bool:
    return fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def this_start(run_dir: Path) -> dict:
    """The record of this job's current start (the newest of this job and restart)."""
    job, restart = os.environ.get("SLURM_JOB_ID"), restart_count() + 1
    mine = [r for r in records.starts(run_dir) if r.get("event") == "start" and r.get("job") == job
            and r.get("start") == restart]
    return mine[-1] if mine else {}


def after_stop(run_dir: Path, signal: str, code: int, attempt: int, fields: dict[str, str]) -> str:
    job = os.environ.get("SLURM_JOB_ID", "?")
    restart = restart_count()
    began = this_start(run_dir)
    # The target is what this start's trainer read (its run record); a start that wrote none
    # (it failed before training, or found the run done) is judged by the newest one, and
    # counts as finished only if it ended well.
    mine = records.newest_run_record(run_dir, job, restart)
    now = records.progress(run_dir, mine)
    finished = (mine is not None or code == 0) and now.target is not None and (now.step or 0) >= now.target
    trained = (now.step or 0) > (began.get("step") or 0) or (now.checkpoint or 0) > (began.get("checkpoint") or 0)
    verdict = decide(fields, restart, signal, code, finished, trained, attempt)
    why = {"USR1": "the time limit is near", "TERM": "SIGTERM", "none": "no signal to the job script"}.get(signal, signal)
    if verdict == "requeue" and preempted(fields):
        why = "preempted"
    elif verdict == "stopped" and signal == "none":
        why = "SIGTERM to the training: scancel --signal=TERM"  # the steps were signalled, not this script
    resume = "`sbatch` the script again (or gamma-titan submit) to resume"
    lines = {
        "finished": f"finished: {run_dir} reached step {now.target}",
        "cancelled": f"cancelled (scancel): stays stopped at step {now.checkpoint}; {resume}",
        "requeued by SLURM": "requeued by SLURM (scontrol requeue): its next start resumes from step "
                             f"{now.checkpoint}",
        "requeue": f"{why}, training stopped with exit {code}: requeueing it; its next start resumes from the "
                   f"stop's checkpoint (step {now.checkpoint})",
        "retry": f"training ended with exit {code} before it trained a step (attempt {attempt} of {MAX_ATTEMPTS}): "
                 "starting it again with a new rendezvous",
        "stopped": f"stopped ({why}), exit {code}: stays stopped at step {now.checkpoint}; {resume}",
        "failed": f"training ended with exit {code} ({why}): not requeued"
                  + (f" (it failed before training {MAX_ATTEMPTS} times)" if not trained and code not in NOT_RESUMABLE
                     and signal == "none" else ""),
    }
    say(lines[verdict])
    records.append_line(run_dir / records.SLURM_FOLDER / records.STARTS_FILE, {
        "event": "end", "job": job, "start": restart + 1, "attempt": attempt, "time": records.now_iso(),
        "verdict": verdict, "why": why, "code": code, "step": now.step, "checkpoint": now.checkpoint,
        "target": now.target})
    return verdict


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: python -m gamma_titan.slurm.job start RUN_DIR GRACE_SECONDS | rendezvous HEAD_ADDR [OTHER_ADDR] "
             "| after-stop RUN_DIR SIGNAL CODE ATTEMPT")
    if argv[:1] == ["start"] and len(argv) == 3:
        print(start(Path(argv[1]), float(argv[2]), job_fields()))
    elif argv[:1] == ["rendezvous"] and len(argv) in (2, 3):
        print(rendezvous(argv[1], argv[2] if len(argv) == 3 and argv[2] else None))
    elif argv[:1] == ["after-stop"] and len(argv) == 5:
        print(after_stop(Path(argv[1]), argv[2], int(argv[3]), int(argv[4]), job_fields()))
    else:
        print(usage, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
