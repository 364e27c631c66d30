"""Every benchmark in tools/bench runs in its --quick mode and ends with its ratio lines.

No threshold is asserted (the targets are for the people who run the full benchmarks on a
quiet machine); what is checked is that each script runs the code paths it measures and
reports a finite, positive ratio for each of them.
"""

import math
import re
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.multiprocess

EXPECTED_RATIOS = {  # script -> how many ratio lines, at the end of its output
    "vs_torchtitan.py": 5,
    "gate_cost.py": 2,
    "compile_speedup.py": 1,
    "data_loader.py": 2,
    "diagnostics_overhead.py": 1,
    "step_guard.py": 1,
}


@pytest.mark.parametrize("script", EXPECTED_RATIOS)
def test_quick_mode_prints_ratios_last(script):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / script), "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    n = EXPECTED_RATIOS[script]
    assert all(line.startswith("ratio ") for line in lines[-n:]), lines[-n - 1:]
    assert not lines[-n - 1].startswith("ratio ")
    for line in lines[-n:]:
        measured = re.sub(r"\([^)]*\)", "", line)  # targets and predictions are in parentheses
        numbers = [float(x) for x in re.findall(r"\d+\.\d+", measured)]
        assert numbers and all(math.isfinite(x) and x > 0 for x in numbers), line
