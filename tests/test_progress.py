"""Progress and ETA (gamma_titan/progress.py): the arithmetic, against a hand count."""

import pytest

from gamma_titan.progress import Eta, hms, progress_line


def test_hms():
    assert [hms(s) for s in (0, 59.4, 61, 3599, 3600, 3661, 90061)] == [
        "0:00", "0:59", "1:01", "59:59", "1:00:00", "1:01:01", "25:01:01"]


def test_the_eta_follows_the_recent_rate_not_the_start():
    now = [0.0]
    eta = Eta(100, window=3, clock=lambda: now[0])
    assert eta.update(1) == (0.0, None)  # one report: no rate yet
    now[0] = 60.0  # a slow first step (compile, a cold cache)
    assert eta.update(2) == (60.0, 98 * 60.0)
    for step in (3, 4, 5):
        now[0] += 2.0
        elapsed, left = eta.update(step)
    assert elapsed == 66.0 and left == 95 * 2.0  # the window (steps 3..5) no longer holds step 2's minute
    assert progress_line(5, 100, elapsed, left) == "step 5/100 (5%), 1:06 elapsed, ETA 3:10"
    assert progress_line(1, 100, 0.0, None) == "step 1/100 (1%), 0:00 elapsed, ETA -"


def test_a_recipes_eta_counts_from_the_start():
    """Runs trained side by side finish in bursts: the rate is the work done since the start."""
    now = [0.0]
    eta = Eta(8, window=None, clock=lambda: now[0])
    now[0] = 10.0
    assert eta.update(2) == (10.0, 30.0)  # 2 units in 10 s: 6 more take 30 s
    now[0] = 10.1  # two runs finishing together do not make the ETA zero
    assert eta.update(3)[1] == pytest.approx(10.1 * 5 / 3)
