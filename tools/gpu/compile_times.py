"""Cold compile times of the GPU check's graphs, measured with CPU Inductor: the basis of its budgets.

    python tools/gpu/compile_times.py [--only NAME ...]

Each of the check's compiled training runs (tools/gpu/checks.py, `COMPILED_RUNS`) runs here
in the order the check runs them, sharing one fresh Inductor cache as they do on the GPU
machine, at the check's widths with the fewest layers that hold every block kind (one
dense block; a dense and an MoE block), a short sequence and 4 steps, in fp32 (this CPU has no bf16
arithmetic: emulated, a step of the 1.5B widths takes minutes; autocast's casts are all
the graphs lose): the graphs are the check's, only smaller tensors flow through them. Compile = step 1's end-to-end seconds
less the median of steps 2-4; launch = the process's wall seconds less all steps. The
budgets in checks.py take these times times GPU_COMPILE_FACTOR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu import checks  # noqa: E402

#: What shrinks a check's run to a CPU: the check's own flags come first, these win.
SMALL = ["--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "1",
         "--training.mixed_precision_param", "float32",
         "--lr_scheduler.warmup_steps", "1", "--compile.enable", "true", "--model_args.n_layers", "2",
         "--gamma.diagnostics.enable", "false"]
#: Runs a CPU cannot compile: emulated float8 refuses compile (pre-flight), so checks.py
#: derives the float8 run's compile from the bf16 one's.
NOT_ON_A_CPU = {"dense_float8": "emulated float8 cannot be compiled (checks.FLOAT8_COMPILE_FACTOR)"}


def measure(name: str, argv: list[str], logs: Path, env: dict) -> dict:
    dump = logs / name
    started = time.monotonic()
    done = subprocess.run([*argv, *SMALL, "--job.dump_folder", str(dump)], capture_output=True, text=True, env=env,
                          cwd=checks.REPO)
    wall = time.monotonic() - started
    records = checks.read_metrics(dump)
    e2e = [r["time_metrics/end_to_end(s)"] for r in records if "time_metrics/end_to_end(s)" in r]
    if done.returncode != 0 or len(e2e) < 4:
        return {"name": name, "error": (done.stdout + done.stderr)[-1500:]}
    steady = statistics.median(e2e[1:])
    return {"name": name, "compile_s": round(e2e[0] - steady, 1), "launch_s": round(wall - sum(e2e), 1),
            "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[])
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compile_times.") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"), "TRITON_CACHE_DIR":
               str(Path(tmp) / "triton")}
        setup = checks.Setup(Path(tmp))
        results = []
        for name, run_argv in checks.compiled_runs(setup):
            if ns.only and name not in ns.only:
                continue
            if name in NOT_ON_A_CPU:
                print(f"{name}: not measured: {NOT_ON_A_CPU[name]}", flush=True)
                continue
            result = measure(name, run_argv, Path(tmp), env)
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"{'run':<22} {'compile s':>9} {'launch s':>9}")
    for r in results:
        print(f"{r['name']:<22} {r.get('compile_s', 'error'):>9} {r.get('launch_s', ''):>9}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
