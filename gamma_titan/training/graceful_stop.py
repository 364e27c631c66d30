"""Graceful stop ([gamma.reliability] stop_grace_seconds): SIGTERM (what SLURM and torchrun
send before a kill), or SIGINT (Ctrl-C at a terminal), makes every rank finish the step in
progress, write a full checkpoint of it and exit 0. If that takes longer than the grace
period, the process exits with 143 and the last complete checkpoint stays the one to resume
from.

A stop often arrives twice: SLURM signals every process of a job step, torchrun among
them, and torchrun forwards the signal to its workers again. A second SIGTERM after a
SIGTERM is that echo and is ignored. Any other second signal is a person insisting (a
second Ctrl-C; under torchrun it arrives as torchrun's SIGTERM after the first SIGINT):
the process exits 130 at once, without a new checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading

from torchtitan.tools.logging import logger

from gamma_titan.training import start_signals


class GracefulStop:
    """SIGTERM sets a flag; the trainer checkpoints at the end of the step and exits 0.
    A watchdog ends the process with 143 if that takes longer than the grace period."""

    EXIT_TIMEOUT = 128 + signal.SIGTERM

    EXIT_INTERRUPTED = start_signals.EXIT_INTERRUPTED
    SIGNALS = start_signals.SIGNALS

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.requested = False
        self.signal: int | None = None  # the first stop signal received
        self.done = threading.Event()
        self._previous: dict = {}

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return  # installed already (before the trainer was built), or not ours to install
        self._previous = {sig: signal.signal(sig, self._on_sigterm) for sig in self.SIGNALS}
        early = start_signals.take()  # one that came while this rank started up (start_signals.py)
        if early is not None:
            self._on_sigterm(early, None)

    def uninstall(self) -> None:
        self.done.set()
        if self._previous and threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._previous = {}

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            if signum == signal.SIGTERM == self.signal:  # the echo of SLURM's signal through torchrun
                return
            logger.error(f"{signal.Signals(signum).name} after {signal.Signals(self.signal).name}: exiting now "
                         "without a new checkpoint")
            os._exit(self.EXIT_INTERRUPTED)
        self.requested, self.signal = True, signum
        logger.warning(f"{signal.Signals(signum).name}: finishing this step, checkpointing it and exiting "
                       f"(at most {self.grace_seconds:g} s)" + ("; Ctrl-C again to exit now" if signum == signal.SIGINT
                                                                 else ""))
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        if not self.done.wait(self.grace_seconds):
            logger.error(f"{signal.Signals(self.signal).name}: no clean stop within gamma.reliability."
                         f"stop_grace_seconds = {self.grace_seconds:g}; exiting without a new checkpoint")
            os._exit(self.EXIT_TIMEOUT)
