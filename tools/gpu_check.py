"""The GPU acceptance check: what a first cluster run relies on, tried on one H100/H200
through the real CLI (`gamma-titan inspect` / `gamma-titan train`).

    bash tools/gpu_check.sh --wheels .wheels [--out DIR/gpu_check.json] [--only NAME ...]
    bash tools/gpu_check.sh --dry-run          # the same pipeline at debug shapes on the CPU
    python tools/gpu_check.py --compare A.json B.json

Checks, in order (PASS conditions: tools/gpu/judges.py; runs and time budgets:
tools/gpu/checks.py; on one GPU the budgets add up to 7 minutes):

  kernels        the SDPA kernel of every attention kind (dense MHA, MoE MHA, MLA); on a GPU
                 none may be the math kernel
  inspect_moe    `gamma-titan inspect` of every MoE config and flavor (one dense and one MoE
                 block at full size)
  dense_bf16     gamma_dense 1.5B, bf16, compile, selective AC, 20 steps, three runs: like
                 TorchTitan's llama3 (γ 0.5, ε 1e-5, no gate) and TorchTitan's llama3 itself at
                 the same shape (tokens/s ratio >= 0.95), then the default knobs (MFU floor,
                 step 1 at the init's loss, the gate's cost next to its FLOP share)
  diagnostics    the live diagnostics of the default run (every 5 steps): the overhead of
                 measuring at freq 1 and at the default freq 100
  moe_mla_bf16   gamma_moe 3B-A0.5B MLA, 20 steps: the loss falls, recompiles bounded,
                 expert load max/mean
  dense_float8   the default dense run with float8 linears: the layers converted (none of the
                 head, router or headwise gate), the loss within a tolerance of bf16's and not
                 identical to it, float8/bf16 tokens/s
  sigterm_drill  SIGTERM to `gamma-titan train`: the save within its estimate, and a run
                 resumed from the step before logs the same next loss
  titan_cp2, qwen3_tp2, deepseek_ep2
                 TorchTitan's models with the knobs: context, tensor and expert parallelism
                 on 2 GPUs against one, in bf16, within a measured tolerance; SKIP on one GPU

A check that outlives its budget is killed with every process it started (torchrun's
workers included) and marked FAIL (timeout); the next one starts only once none of them
is left and the GPU's memory is back to its level before the checks. The JSON (`--out`)
is written after every check: run again with the same `--out` and the finished checks
are kept (`--only NAME` reruns one). The last lines are one table: check, status,
seconds, the key figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import checks  # noqa: E402
from gpu.judges import Verdict  # noqa: E402
from gpu.procs import become_subreaper, gpu_memory_used_mib, kill_descendants, wait_released  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = {False: "outputs/gpu_check/gpu_check.json", True: "outputs/gpu_check_dry_run/gpu_check.json"}


@dataclass
class Step:
    """What runs together: one budget, one or more checks (kernels and inspect_moe share a process)."""

    name: str
    checks: tuple[str, ...]
    budget: int
    run: Callable[[float], list[tuple[str, Verdict]]]  # deadline (monotonic) -> verdicts


def build_steps(setup: checks.Setup) -> list[Step]:
    one = lambda name, fn: Step(name, (name,), setup.budget(name), lambda d: [(name, fn(setup, d))])  # noqa: E731
    return [
        Step("inspect", ("kernels", "inspect_moe"), setup.budget("inspect"),
             lambda d: checks.inspect_all(setup, d)),
        one("dense_bf16", checks.dense_bf16),
        Step("diagnostics", ("diagnostics",), setup.budget("diagnostics"),
             lambda d: [("diagnostics", checks.diagnostics(setup))]),
        one("moe_mla_bf16", checks.moe_mla_bf16),
        one("dense_float8", checks.dense_float8),
        one("sigterm_drill", checks.sigterm_drill),
        *[Step(name, (name,), setup.budget(name), lambda d, n=name: [(n, checks.layout_check(setup, n, d))])
          for name in checks.LAYOUTS],
    ]


def check_names(steps: list[Step]) -> list[str]:
    return [c for step in steps for c in step.checks]


# --- the machine -------------------------------------------------------------------------------

def machine(dry_run: bool) -> dict:
    """Versions and devices, without creating a CUDA context in this process."""
    from importlib import metadata

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    for package in ("torchtitan", "torchao", "datasets", "transformers", "triton"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        rows = [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]
        info["gpu_names"] = [r[0] for r in rows]
        info["driver"] = rows[0][1] if rows else None
        info["gpu_memory"] = [r[2] for r in rows]
    if not dry_run and info["gpus"] == 0:
        sys.exit(f"error: torch {torch.__version__} sees no CUDA device (--dry-run runs the pipeline on the CPU)")
    info["device"] = (info.get("gpu_names") or ["cpu"])[0] + (" (dry run: debug shapes, CPU)" if dry_run else "")
    return info


# --- the run ---------------------------------------------------------------------------------------

def status(entry: dict) -> str:
    if entry["passed"] is None:
        return "SKIP"
    if entry["passed"]:
        return "PASS"
    return "FAIL (timeout)" if entry.get("timed_out") else "FAIL"


def run_steps(steps: list[Step], out: Path, report: dict, only: list[str], baseline) -> dict:
    """Run every step not finished in `report` (or named in `only`), writing `out` after each."""
    done = report.setdefault("checks", {})
    for step in steps:
        rerun = any(c in only for c in step.checks)
        if only and not rerun or not only and all(c in done for c in step.checks):
            continue
        for name in step.checks:
            if name in done:
                report.setdefault("replaced", {}).setdefault(name, []).append(done.pop(name))
        started = time.monotonic()
        deadline = started + step.budget
        try:
            verdicts = step.run(deadline)
        except Exception as e:  # noqa: BLE001  (a broken check is a FAIL, the next one still runs)
            verdicts = [(name, Verdict(False, f"{type(e).__name__}: {e}"[:300], {}, ["crashed"])) for name in step.checks]
        seconds = time.monotonic() - started
        kill_descendants()
        held = wait_released(baseline)
        for name, verdict in verdicts:
            entry = {"passed": verdict.passed, "figure": verdict.figure, "seconds": round(seconds, 1),
                     "budget_seconds": step.budget, **verdict.details}
            if verdict.passed is not None and seconds > step.budget:
                entry |= {"passed": False, "timed_out": True}
            if held:
                entry |= {"passed": False, "figure": f"still held after the check: {held} | {entry['figure']}"}
            done[name] = entry
            print(f"{status(entry):<14} {name:<14} {entry['seconds']:>6.0f} s  {entry['figure']}", flush=True)
        report.setdefault("step_seconds", {})[step.name] = round(seconds, 1)
        out.write_text(json.dumps(report, indent=2) + "\n")
        if held:
            print(f"stopping: the GPU or processes of {step.name} are still held ({held}); rerun with the same "
                  f"--out once they are gone", flush=True)
            break
    return report


def table(report: dict, names: list[str]) -> str:
    """One line per check: name, status, seconds, key figure."""
    rows = [f"{'check':<14} {'status':<14} {'seconds':>7}  figure", "-" * 78]
    for name in names:
        entry = report["checks"].get(name)
        if entry is None:
            rows.append(f"{name:<14} {'NOT RUN':<14} {'':>7}")
        else:
            rows.append(f"{name:<14} {status(entry):<14} {entry.get('seconds', 0):>7.0f}  {entry['figure'][:160]}")
    return "\n".join(rows)


def compare(a: Path, b: Path) -> str:
    """Two gpu_check.json side by side: per check, status and seconds of each, and the figures."""
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    lines = [f"A: {a} ({ra.get('machine', {}).get('device')}, torch {ra.get('machine', {}).get('torch')})",
             f"B: {b} ({rb.get('machine', {}).get('device')}, torch {rb.get('machine', {}).get('torch')})",
             f"{'check':<14} {'A':<16} {'B':<16}"]
    for name in dict.fromkeys([*ra.get("checks", {}), *rb.get("checks", {})]):
        cells = []
        for r in (ra, rb):
            e = r.get("checks", {}).get(name)
            cells.append(f"{status(e)} {e.get('seconds', 0):.0f} s" if e else "-")
        lines.append(f"{name:<14} {cells[0]:<16} {cells[1]:<16}")
        for label, r in (("A", ra), ("B", rb)):
            e = r.get("checks", {}).get(name)
            if e:
                lines.append(f"{'':<14} {label}: {e['figure'][:150]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inspect"]:
        return checks.inspect_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help=f"the JSON report (default {DEFAULT_OUT[False]}; with --dry-run "
                                      f"{DEFAULT_OUT[True]}); an existing one is resumed")
    parser.add_argument("--dry-run", action="store_true", help="debug configs, eager, on the CPU")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run (again) only this check; repeatable")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"))
    ns = parser.parse_args(argv)
    if ns.compare:
        print(compare(*ns.compare))
        return 0
    out = Path(ns.out or REPO / DEFAULT_OUT[ns.dry_run])
    logs = out.with_name(out.stem + "_logs")
    setup = checks.Setup(logs, dry_run=ns.dry_run)
    steps = build_steps(setup) if steps is None else steps
    names = check_names(steps)
    for name in ns.only:
        if name not in names:
            parser.error(f"--only {name}: not a check (one of {', '.join(names)})")
    report = json.loads(out.read_text()) if out.exists() else {}
    if report and report.get("dry_run") != ns.dry_run:
        parser.error(f"--out {out}: holds a {'dry' if report.get('dry_run') else 'GPU'} run; this is a "
                     f"{'dry' if ns.dry_run else 'GPU'} run (choose another --out)")
    info = machine(ns.dry_run)
    setup.gpus = info["gpus"]
    logs.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    if report:
        kept = [c for c in names if c in report.get("checks", {}) and c not in ns.only]
        print(f"resuming {out}: keeping {', '.join(kept) or 'nothing'}", flush=True)
        report.setdefault("earlier_machines", []).append(report.get("machine"))
    report |= {"dry_run": ns.dry_run, "machine": info}
    print(f"gamma-titan GPU check on {info['device']}: torch {info['torch']}, CUDA {info['cuda']}, "
          f"driver {info.get('driver')}, torchtitan {info['torchtitan']}, torchao {info['torchao']}, "
          f"Python {info['python']}", flush=True)
    run_steps(steps, out, report, ns.only, gpu_memory_used_mib())
    print("\n" + table(report, names))
    entries = [report["checks"][n] for n in names if n in report["checks"]]
    failed = [n for n in names if n in report["checks"] and report["checks"][n]["passed"] is False]
    ran = [e for e in entries if e["passed"] is not None]
    print(f"{len(ran) - len(failed)}/{len(ran)} passed, {len(entries) - len(ran)} skipped, "
          f"{len(names) - len(entries)} not run; {sum(report.get('step_seconds', {}).values()):.0f} s of checks"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + f". JSON: {out}, logs: {logs}/", flush=True)
    return 1 if failed or len(entries) < len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
