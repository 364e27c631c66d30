"""tools/gpu_check.py's driver with stand-in checks (tests/test_gpu_check.py): the real
budgets, kills, waits, resume and --only, without a trainer.

    python gpu_check_fake.py STATE_DIR [gpu_check.py arguments]

Steps, in order:
  sleeper   (budget 2 s) a child that starts a grandchild in a session of its own, which
            writes its pid to STATE_DIR/grandchild.pid and sleeps; the child sleeps too
  quick_a   PASS at once (each run appends a line to STATE_DIR/quick_a.runs)
  quick_b   PASS at once, or FAIL when STATE_DIR/fail_b exists (STATE_DIR/quick_b.runs)
Set GAMMA_TITAN_FAKE_SLEEPER=0 to leave the sleeper out, GAMMA_TITAN_FAKE_SLEEPER_BUDGET=S
to give it S seconds. The scratch folder is STATE_DIR/scratch; every check writes a log there. The GPU's memory is released
within 2 s or not at all (a fake nvidia-smi on PATH says how much is used).
"""

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import gpu_check  # noqa: E402
from gpu.judges import Verdict  # noqa: E402
from gpu import procs  # noqa: E402
from gpu.procs import run_until  # noqa: E402

procs.RELEASE_TIMEOUT_S = 2.0

state = Path(sys.argv[1])

GRANDCHILD = f"""
import os, subprocess, sys, time
code = "import os, time; open({str(state / 'grandchild.pid')!r}, 'w').write(str(os.getpid())); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
time.sleep(600)
"""


def logs() -> Path:
    """The driver's scratch logs (Setup.logs of the real checks)."""
    return state / "scratch" / "logs"


def sleeper(deadline: float):
    done = run_until([sys.executable, "-c", GRANDCHILD], state / "sleeper.log", deadline)
    (logs() / "sleeper.log").write_text(f"exit {done.code}\n")
    return [("sleeper", Verdict(not done.timed_out, f"exit {done.code}", {"killed_at": time.time()}))]


def quick(name: str):
    def run(deadline: float):
        with open(state / f"{name}.runs", "a") as f:
            f.write(f"{time.time()}\n")
        (logs() / f"{name}.log").write_text("ran\n")
        passed = not (name == "quick_b" and (state / "fail_b").exists())
        return [(name, Verdict(passed, "fine" if passed else "broken", {"started": time.time()}))]
    return run


steps = [gpu_check.Step("quick_a", ("quick_a",), 30, quick("quick_a")),
         gpu_check.Step("quick_b", ("quick_b",), 30, quick("quick_b"))]
if os.environ.get("GAMMA_TITAN_FAKE_SLEEPER", "1") == "1":
    budget = int(os.environ.get("GAMMA_TITAN_FAKE_SLEEPER_BUDGET", "2"))
    steps.insert(0, gpu_check.Step("sleeper", ("sleeper",), budget, sleeper))
sys.exit(gpu_check.main([*sys.argv[2:], "--scratch", str(state / "scratch")], steps=steps))
