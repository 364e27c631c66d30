"""How far a long job is, and when it will end: the trainer's step lines and `recipe run`.

A leaf module (it imports nothing of the package). A training run's ETA comes from recent
progress only (the last `window` reports), so a slow start (compile, a cold cache) or a
resumed run does not skew it; a recipe's (`window=None`) from all of it since the start,
because runs trained side by side finish in bursts.
"""

from __future__ import annotations

import time
from collections import deque


def hms(seconds: float) -> str:
    """1:02:03 (or 2:03 under an hour)."""
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Eta:
    """Work done out of `total` units (steps, or a run's planned compute), reported as it goes."""

    def __init__(self, total: float, window: int | None = 10, clock=time.monotonic) -> None:
        self.total, self.clock = total, clock
        self.start = clock()
        self.recent: deque[tuple[float, float]] = deque(maxlen=window)  # (time, units done)
        if window is None:
            self.recent.append((self.start, 0.0))

    def update(self, done: float) -> tuple[float, float | None]:
        """(seconds since the start, seconds left at the recent rate; None until a rate is known)."""
        now = self.clock()
        self.recent.append((now, done))
        (t0, d0), (t1, d1) = self.recent[0], self.recent[-1]
        left = None
        if d1 > d0 and t1 > t0:
            left = (self.total - d1) * (t1 - t0) / (d1 - d0)
        return now - self.start, left


def progress_line(done: float, total: float, elapsed: float, left: float | None, unit: str = "step") -> str:
    """"step 12/200 (6%), 0:34 elapsed, ETA 8:53" (ETA - before the rate is known)."""
    share = f" ({100 * done / total:.0f}%)" if total else ""
    return f"{unit} {done:g}/{total:g}{share}, {hms(elapsed)} elapsed, ETA {'-' if left is None else hms(left)}"
