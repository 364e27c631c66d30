"""Graceful stop ([gamma.reliability] stop_grace_seconds): SIGTERM (what SLURM and torchrun
send before a kill), or SIGINT (Ctrl-C at a terminal), makes every rank finish the step in
progress, write a full checkpoint of it and exit 0; a second Ctrl-C exits at once, the last
complete checkpoint staying the one to resume from. If that takes longer than the grace
period, the process exits with 143 and the last complete checkpoint stays the one to resume
from."""

from __future__ import annotations

import os
import signal
import threading

from torchtitan.tools.logging import logger


class GracefulStop:
    """SIGTERM sets a flag; the trainer checkpoints at the end of the step and exits 0.
    A watchdog ends the process with 143 if that takes longer than the grace period."""

    EXIT_TIMEOUT = 128 + signal.SIGTERM

    EXIT_INTERRUPTED = 128 + signal.SIGINT
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.requested = False
        self.done = threading.Event()
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_sigterm) for sig in self.SIGNALS}

    def uninstall(self) -> None:
        self.done.set()
        if self._previous and threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._previous = {}

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            if signum == signal.SIGINT:  # Ctrl-C twice: now
                logger.error("SIGINT again: exiting now without a new checkpoint")
                os._exit(self.EXIT_INTERRUPTED)
            return
        self.requested = True
        logger.warning(f"{signal.Signals(signum).name}: finishing this step, checkpointing it and exiting "
                       f"(at most {self.grace_seconds:g} s)" + ("; Ctrl-C again to exit now" if signum == signal.SIGINT
                                                                 else ""))
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self) -> None:
        if not self.done.wait(self.grace_seconds):
            logger.error(f"SIGTERM: no clean stop within gamma.reliability.stop_grace_seconds = "
                         f"{self.grace_seconds:g}; exiting without a new checkpoint")
            os._exit(self.EXIT_TIMEOUT)
