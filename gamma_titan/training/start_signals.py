"""A stop signal that reaches a rank while it starts up: held, not fatal.

A rank spends seconds importing torch and checking its config before the graceful stop
(graceful_stop.py) is installed; a SIGTERM then (a job's time limit or a preemption that
lands on a start) killed it without a word, and its node's launcher reported a failure.
`hold()` runs first thing in the entry point (gamma_titan/train.py) and keeps the first
SIGTERM or SIGINT; the graceful stop, once installed, takes it over (`take()`), and the
rank stops after its first step with a checkpoint, as for any stop during start-up.

The rules are the graceful stop's: a second SIGTERM after a SIGTERM is the echo of SLURM's
signal through torchrun and is ignored; any other second signal is a person insisting, and
the process exits 130 at once.
"""

from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_INTERRUPTED = 128 + signal.SIGINT

_held: list[int] = []


def _hold(signum, frame) -> None:
    if _held:
        if signum == signal.SIGTERM == _held[0]:
            return
        os._exit(EXIT_INTERRUPTED)
    _held.append(signum)


def hold() -> None:
    """Keep the first stop signal from now until the graceful stop is installed; and tell
    this node's launcher that this worker has started (torchrun.py)."""
    from gamma_titan.training.torchrun import write_start_report

    for sig in SIGNALS:
        signal.signal(sig, _hold)
    write_start_report()


def take() -> int | None:
    """The stop signal that arrived during start-up, if any (then forgotten: the caller
    handles it)."""
    return _held.pop() if _held else None
