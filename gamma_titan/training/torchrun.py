"""torchrun, with the ends a scheduler reads: `python -m gamma_titan.training.torchrun ARGS`
takes torchrun's own arguments and runs torchrun (torch.distributed.run) in this process.

torchrun alone turns every signal into a failure: it forwards SIGTERM or SIGINT to its
workers, waits for them, then re-raises the signal and exits 1 with a traceback, even when
every worker finished its step, checkpointed it and exited 0 (measured, torch 2.13). A
SLURM `afterok` chain or a requeue script reads that as a crash. Here:

* a stop (SIGTERM, SIGINT, SIGHUP) after which every worker of this node reported a clean
  end (`GAMMA_TITAN_STOP_REPORTS`: each writes its exit code there as it leaves) exits with
  the workers' code, 0 after a checkpoint, in one line and no traceback;
* a stop after which a worker did not report (killed, or cut off by the grace period)
  exits 1, naming the local ranks;
* a stop before any worker of this node started (during the rendezvous, or while the
  workers import: each says when it starts, `write_start_report`) exits 0: there was no
  step to checkpoint, and the newest checkpoint is the one to resume from;
* a failed worker exits with its own exit code (3 non-finite, 4 disk full, ...) and
  torchrun's summary of the failure, without the launcher's traceback.

A second Ctrl-C reaches the workers as torchrun's SIGTERM after their SIGINT, which ends
them at once (graceful_stop.py); this process then exits 130.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

#: The folder where each worker of this node writes `<local rank>.json` as it leaves.
STOP_REPORTS_ENV = "GAMMA_TITAN_STOP_REPORTS"
#: The node that hosts the c10d rendezvous store (SLURM's name for it; a job script sets it).
#: torchrun otherwise guesses the host by the endpoint's address: on a node that shares it,
#: a port already held (another job's store) makes it join that store quietly as a client.
RDZV_HOST_ENV = "GAMMA_TITAN_RDZV_HOST"


def with_store_host(rdzv_conf: str, host: str | None, node: str | None) -> str:
    """torchrun's --rdzv-conf with is_host said, where the store's host is named: the host
    binds the port or fails (a start tried again), every other node connects."""
    if not host or not node or "is_host" in rdzv_conf:
        return rdzv_conf
    return ",".join(filter(None, [rdzv_conf, f"is_host={'1' if node == host else '0'}"]))


def write_stop_report(code: int, stopped_at: int | None) -> None:
    """A worker's end, for the launcher of its node (nothing without one)."""
    folder = os.environ.get(STOP_REPORTS_ENV)
    if not folder or not os.path.isdir(folder):
        return
    local_rank = os.environ.get("LOCAL_RANK", "0")
    tmp = Path(folder) / f".{local_rank}.tmp"
    tmp.write_text(json.dumps({"code": code, "stopped_at": stopped_at}))
    tmp.replace(Path(folder) / f"{local_rank}.json")


def write_start_report() -> None:
    """A worker that has started (its stop signals are kept from now on: start_signals.py)."""
    folder = os.environ.get(STOP_REPORTS_ENV)
    if folder and os.path.isdir(folder):
        (Path(folder) / f"{os.environ.get('LOCAL_RANK', '0')}.started").touch()


def read_stop_reports(folder: Path, nproc: int) -> dict[int, dict | None]:
    out = {}
    for rank in range(nproc):
        try:
            out[rank] = json.loads((folder / f"{rank}.json").read_text())
        except (OSError, ValueError):
            out[rank] = None
    return out


def after_signal(reports: dict[int, dict | None], sig: int, started: bool = True) -> tuple[int, str]:
    """(exit code, line) of this node once a stop signal has ended its workers; `started`:
    whether any of them had started."""
    name = signal.Signals(sig).name
    if not started:
        return 0, (f"gamma-titan: {name} before any worker of this node started: no step to checkpoint; the newest "
                   "checkpoint is the one to resume from")
    missing = [rank for rank, r in reports.items() if r is None]
    if missing:
        code = 130 if sig == signal.SIGINT else 1
        return code, (f"gamma-titan: {name}: local rank(s) {', '.join(map(str, missing))} of this node ended "
                      "without a clean stop (killed, or over gamma.reliability.stop_grace_seconds); the last "
                      "complete checkpoint is the one to resume from")
    code = max(r["code"] for r in reports.values())
    steps = sorted({r["stopped_at"] for r in reports.values() if r.get("stopped_at") is not None})
    where = f"checkpointed step {steps[0]}" if len(steps) == 1 else "stopped"
    if code:
        return code, f"gamma-titan: {name}: the workers of this node ended with exit {code}"
    return 0, f"gamma-titan: {name}: every worker of this node {where} and exited 0"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.rdzv_backend == "c10d":
        args.rdzv_conf = with_store_host(args.rdzv_conf, os.environ.get(RDZV_HOST_ENV),
                                         os.environ.get("SLURMD_NODENAME"))
    reports = Path(tempfile.mkdtemp(prefix="gamma-titan-stop."))
    os.environ[STOP_REPORTS_ENV] = str(reports)  # the workers inherit it
    # torchrun's own handler, from now rather than from when the workers start: a stop during
    # the rendezvous ends in the same SignalException (the default would kill this process)
    def stop(signum, frame):
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        run(args)
        return 0
    except SignalException as e:
        nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else len(list(reports.glob("*.json")))
        started = any(reports.glob("*.started"))
        code, line = after_signal(read_stop_reports(reports, nproc), e.sigval, started)
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
        return code
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        print(str(e), file=sys.stderr, flush=True)  # torchrun's summary: which rank, its exit code, its error
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    finally:
        shutil.rmtree(reports, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
