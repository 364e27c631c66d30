"""The GPU acceptance check: what a first cluster run relies on, tried on one H100/H200
through the real CLI (`gamma-titan inspect` / `gamma-titan train`).

    timeout 590 bash tools/gpu_check.sh --wheels .wheels --report-dir "$OUT"   # on the GPU machine
    bash tools/gpu_check.sh --dry-run          # the same pipeline at debug shapes on the CPU
    python tools/gpu_check.py --compare A.json B.json

Checks, in the order of what they prove for a cluster run (PASS conditions:
tools/gpu/judges.py; runs and time budgets: tools/gpu/checks.py); each judges only what
it ran, and a figure that needs another check's run reads "not measured" without it:

  dense_bf16     gamma_dense 1.5B with the default knobs, bf16, compile, selective AC, 12
                 steps: the MFU floor, step 1 at the init's loss, no graph break
  dense_vs_titan gamma_dense like TorchTitan's llama3 (γ 0.5, ε 1e-5, no gate) and llama3
                 itself at the same shape: tokens/s ratio >= 0.95; the gate's cost
  dense_float8   float8 linears: the layers converted (none of the head, router or
                 headwise gate), the loss falls; against dense_bf16's loss and tokens/s
  moe_mla_bf16   gamma_moe 3B-A0.5B MLA: the loss falls, recompiles bounded; expert load,
                 tokens/s and MFU (active parameters) printed
  sigterm_drill  the disk's write bandwidth measured; SIGTERM to `gamma-titan train`: the
                 save within what that disk allows, and a resumed run logs the same loss
  diagnostics    the live diagnostics of dense_bf16's run (every 5 steps): their overhead
  kernels, inspect_moe
                 the SDPA kernel of every attention kind (none the math kernel on a GPU);
                 `gamma-titan inspect` of every MoE config and flavor
  moe_vs_titan   gamma_moe 3B-A0.5B MLA like TorchTitan's deepseek_v3 (γ 0.5, ε 1e-5, no
                 gate, no sequence-wise balance loss) and deepseek_v3 itself at the same
                 shape: tokens/s ratio >= 0.95
  titan_cp2, dense_cp2, moe_cp2, moe_mla_cp2, qwen3_tp2, deepseek_ep2
                 context parallelism (TorchTitan's llama3, gamma_dense, gamma_moe MHA and
                 MLA), TorchTitan's qwen3 tensor and deepseek_v3 expert parallelism, with
                 the knobs, on 2 GPUs against one, in bf16, within a measured tolerance;
                 SKIP on one GPU

The plan (each check's budget and their sum) is printed first. A check that outlives its
budget is killed with every process it started (torchrun's workers included) and marked
FAIL (timeout); the next one starts once none of them is left and the GPU's memory is
back to its level before the checks. After every check, `--report-dir` (at most 8 files,
no subfolder) gets gpu_check.json, summary.txt (the table) and logs.tar.gz (every run's
log and metrics, no checkpoint, under 16 MiB); gpu_check.sh adds console.log. Runs and
checkpoints live in a scratch folder (`--scratch`, default a new one under $TMPDIR),
removed at the end. Run again with the same `--report-dir` and the finished checks are
kept (`--only NAME` reruns one).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gamma_titan.config.flags import number  # noqa: E402
from gpu import checks  # noqa: E402
from gpu.judges import Verdict  # noqa: E402
from gpu.procs import become_subreaper, gpu_memory_used_mib, kill_descendants, spare_current_descendants, \
    wait_released  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REPORT_DIR = {False: "outputs/gpu_check", True: "outputs/gpu_check_dry_run"}
REPORT, SUMMARY, ARCHIVE = "gpu_check.json", "summary.txt", "logs.tar.gz"
#: What may come back from the GPU machine: a file at most this large.
MAX_ARCHIVE_BYTES = 15 * 2**20
#: A log larger than this goes into the archive as its head and tail.
MAX_LOG_BYTES = 2 * 2**20


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
        one("dense_bf16", checks.dense_bf16),
        one("dense_float8", checks.dense_float8),
        one("moe_mla_bf16", checks.moe_mla_bf16),
        one("sigterm_drill", checks.sigterm_drill),
        one("dense_vs_titan", checks.dense_vs_titan),
        Step("diagnostics", ("diagnostics",), setup.budget("diagnostics"),
             lambda d: [("diagnostics", checks.diagnostics(setup))]),
        Step("inspect", ("kernels", "inspect_moe"), setup.budget("inspect"),
             lambda d: checks.inspect_all(setup, d)),
        # last of the one-GPU checks: a speed comparison, the first to go where time runs out
        one("moe_vs_titan", checks.moe_vs_titan),
        *[Step(name, (name,), setup.budget(name), lambda d, n=name: [(n, checks.layout_check(setup, n, d))])
          for name in checks.LAYOUTS],
    ]


def check_names(steps: list[Step]) -> list[str]:
    return [c for step in steps for c in step.checks]


def plan(steps: list[Step], gpus: int) -> str:
    """Each step's budget and their sum, before the first check."""
    lines = [f"plan: {len(steps)} steps, budgets in seconds (checks that need more GPUs than {gpus} SKIP at once)"]
    total = 0
    for step in steps:
        needs = checks.LAYOUTS[step.name].gpus if step.name in checks.LAYOUTS else 1
        runs = needs <= gpus
        total += step.budget if runs else 0
        lines.append(f"  {step.name:<16} {step.budget:>5}{'' if runs else '  (skipped here)'}")
    lines.append(f"  {'sum':<16} {total:>5}  (+ install and assets <= {checks.INSTALL_SECONDS} s)")
    return "\n".join(lines)


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


def run_steps(steps: list[Step], report_dir: Path, logs: Path, report: dict, only: list[str], baseline,
              time_limit: float | None = None) -> dict:
    """Run every step not finished in `report` (or named in `only`), writing the report
    folder after each. A step whose budget no longer fits in `time_limit` seconds (from
    the first step) is not started: NOT RUN, for a rerun with the same report folder."""
    done = report.setdefault("checks", {})
    names = check_names(steps)
    begun = time.monotonic()
    for step in steps:
        rerun = any(c in only for c in step.checks)
        if only and not rerun or not only and all(c in done for c in step.checks):
            continue
        left = None if time_limit is None else time_limit - (time.monotonic() - begun)
        if left is not None and step.budget > left:
            print(f"{'NOT RUN':<14} {step.name:<14} {'':>8}  no time left: its budget is {step.budget} s, "
                  f"{max(left, 0):.0f} s of --time-limit {time_limit:.0f} s left", flush=True)
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
        write_report(report_dir, logs, report, names)
        if held:
            print(f"stopping: the GPU or processes of {step.name} are still held ({held}); rerun with the same "
                  f"--report-dir once they are gone", flush=True)
            break
    return report


def write_report(report_dir: Path, logs: Path, report: dict, names: list[str]) -> None:
    """gpu_check.json, summary.txt and logs.tar.gz, each replaced whole (a reader never sees half)."""
    for name, text in ((REPORT, json.dumps(report, indent=2) + "\n"), (SUMMARY, table(report, names) + "\n" +
                                                                      totals(report, names) + "\n")):
        tmp = report_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(report_dir / name)
    archive_logs(logs, report_dir / ARCHIVE)


def archive_logs(logs: Path, dest: Path, limit: int = MAX_ARCHIVE_BYTES) -> None:
    """Every file under `logs` but checkpoints, compressed into `dest` (under `limit` bytes):
    a log over MAX_LOG_BYTES goes in as its head and tail; if the archive is still too large,
    the cut is halved until it fits."""
    files = sorted(p for p in logs.rglob("*") if p.is_file() and "checkpoint" not in p.relative_to(logs).parts)
    cap = MAX_LOG_BYTES
    tmp = dest.with_name(f".{dest.name}.tmp")
    while True:
        with tarfile.open(tmp, "w:gz") as tar:
            for path in files:
                add_capped(tar, path, path.relative_to(logs.parent).as_posix(), cap)
        if tmp.stat().st_size <= limit or cap < 4096:
            break
        cap //= 2
    tmp.replace(dest)


def add_capped(tar: tarfile.TarFile, path: Path, arcname: str, cap: int) -> None:
    import io

    size = path.stat().st_size
    if size <= cap:
        tar.add(path, arcname)
        return
    with open(path, "rb") as f:
        head = f.read(cap // 4)
        f.seek(size - (cap - cap // 4))
        tail = f.read()
    data = head + f"\n[... {size - len(head) - len(tail)} bytes cut ...]\n".encode() + tail
    info = tarfile.TarInfo(arcname)
    info.size, info.mtime = len(data), int(path.stat().st_mtime)
    tar.addfile(info, io.BytesIO(data))


def restore_logs(report_dir: Path, logs: Path) -> None:
    """An earlier run's logs (for checks that read another's run, e.g. diagnostics)."""
    archive = report_dir / ARCHIVE
    if archive.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(logs.parent, filter="data")


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


def totals(report: dict, names: list[str]) -> str:
    entries = [report["checks"][n] for n in names if n in report["checks"]]
    failed = [n for n in names if n in report["checks"] and report["checks"][n]["passed"] is False]
    ran = [e for e in entries if e["passed"] is not None]
    return (f"{len(ran) - len(failed)}/{len(ran)} passed, {len(entries) - len(ran)} skipped, "
            f"{len(names) - len(entries)} not run; {sum(report.get('step_seconds', {}).values()):.0f} s of checks"
            + (f"; FAILED: {', '.join(failed)}" if failed else ""))


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inspect"]:
        return checks.inspect_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-dir", type=Path,
                        help=f"where the report goes (default {DEFAULT_REPORT_DIR[False]}; with --dry-run "
                             f"{DEFAULT_REPORT_DIR[True]}); an existing report is resumed")
    parser.add_argument("--scratch", type=Path, help="runs and checkpoints (default: a new folder under $TMPDIR); "
                                                     "removed at the end")
    parser.add_argument("--dry-run", action="store_true", help="debug configs, eager, on the CPU")
    parser.add_argument("--time-limit", type=number(0), metavar="SECONDS",
                        help=f"start no check whose budget would end after this many seconds of checks (default on "
                             f"a GPU: {checks.ONE_GPU_SECONDS}, the 8 minutes less the install; none in a dry run)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run (again) only this check; repeatable")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"))
    ns = parser.parse_args(argv)
    if ns.compare:
        print(compare(*ns.compare))
        return 0
    report_dir = ns.report_dir or REPO / DEFAULT_REPORT_DIR[ns.dry_run]
    if report_dir.exists() and not report_dir.is_dir():
        parser.error(f"--report-dir {report_dir}: not a folder")
    out = report_dir / REPORT
    report = json.loads(out.read_text()) if out.exists() else {}
    if report and report.get("dry_run") != ns.dry_run:
        parser.error(f"--report-dir {report_dir}: holds a {'dry' if report.get('dry_run') else 'GPU'} run; this is a "
                     f"{'dry' if ns.dry_run else 'GPU'} run (choose another --report-dir)")
    if ns.scratch is not None and ns.scratch.exists() and any(ns.scratch.iterdir()):
        parser.error(f"--scratch {ns.scratch}: not empty (it is removed at the end: give a new folder)")
    info = machine(ns.dry_run)
    scratch = ns.scratch or Path(tempfile.mkdtemp(prefix="gamma-titan-gpu-check."))
    logs = scratch / "logs"
    setup = checks.Setup(logs, dry_run=ns.dry_run, gpus=info["gpus"])
    real = steps is None
    steps = build_steps(setup) if real else steps
    names = check_names(steps)
    for name in ns.only:
        if name not in names:
            parser.error(f"--only {name}: not a check (one of {', '.join(names)})")
    report_dir.mkdir(parents=True, exist_ok=True)
    # `timeout` (README) sends SIGTERM: stop the check in progress, keep what was measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        logs.mkdir(parents=True, exist_ok=True)
        if real:
            checks.preload()  # imports out of every check's timed window
        become_subreaper()
        spare_current_descendants()  # gpu_check.sh's tee of the console
        if report:
            restore_logs(report_dir, logs)
            kept = [c for c in names if c in report.get("checks", {}) and c not in ns.only]
            print(f"resuming {out}: keeping {', '.join(kept) or 'nothing'}", flush=True)
            report.setdefault("earlier_machines", []).append(report.get("machine"))
        report |= {"dry_run": ns.dry_run, "machine": info}
        print(f"gamma-titan GPU check on {info['device']}: torch {info['torch']}, CUDA {info['cuda']}, "
              f"driver {info.get('driver')}, torchtitan {info['torchtitan']}, torchao {info['torchao']}, "
              f"Python {info['python']}", flush=True)
        print(plan(steps, 1 if ns.dry_run else info["gpus"]), flush=True)
        limit = ns.time_limit if ns.time_limit is not None else None if ns.dry_run else checks.ONE_GPU_SECONDS
        run_steps(steps, report_dir, logs, report, ns.only, gpu_memory_used_mib(), limit)
    finally:
        kill_descendants()
        if report:
            write_report(report_dir, logs, report, names)
        shutil.rmtree(scratch, ignore_errors=True)
    print("\n" + table(report, names))
    entries = [n for n in names if n in report["checks"]]
    failed = [n for n in entries if report["checks"][n]["passed"] is False]
    print(f"{totals(report, names)}. Report: {report_dir}/ ({', '.join(sorted(p.name for p in report_dir.iterdir()))})",
          flush=True)
    return 1 if failed or len(entries) < len(names) else 0


if __name__ == "__main__":
    sys.exit(main())
