"""tools/gpu_check.sh, the GPU acceptance check, in its --dry-run mode on the CPU: every
check runs through the real CLI at debug shapes and prints its PASS line with a figure,
and the JSON report holds the numbers behind each line."""

import json
import subprocess

import pytest

from helpers import REPO

pytestmark = pytest.mark.multiprocess

CHECKS = ["kernels", "inspect_moe", "dense_bf16", "moe_mla_bf16", "dense_float8", "sigterm_drill"]


def test_dry_run_passes_every_check_and_never_overwrites(tmp_path, builtin_assets):
    out = tmp_path / "gpu_check.json"
    cmd = ["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split()[1] for line in lines] == CHECKS and all(line.startswith("PASS ") for line in lines)

    report = json.loads(out.read_text())
    assert report["dry_run"] and report["passed"] and list(report["checks"]) == CHECKS
    checks = report["checks"]
    assert set(checks["kernels"]["kernels"]) == {"dense/debug mha", "moe/debug mha", "moe/debug_mla mla"}
    assert checks["kernels"]["kernels"]["dense/debug mha"]["kernel"] == "flash_cpu"
    assert checks["inspect_moe"]["inspected"] == ["dense/debug", "moe/debug", "moe/debug_mla"]
    for name in ("dense_bf16", "moe_mla_bf16", "dense_float8"):
        c = checks[name]
        assert c["exit"] == 0 and c["steps"] == 3 and c["graph_breaks"] == 0
        assert c["tokens_per_s"] > 0 and c["peak_active_gib"] > 0 and c["final_loss"] < 9
    logs = tmp_path / "gpu_check_logs"
    assert "Swapped to Float8Linear" in (logs / "dense_float8.log").read_text()
    # the start-up log names each attention kind's kernel, the math one as a warning
    assert "WARNING - attention mla: SDPA kernel math" in (logs / "moe_mla_bf16.log").read_text()
    assert "attention mha: SDPA kernel flash_cpu" in (logs / "dense_bf16.log").read_text()
    assert "--shutdown-timeout=360" in (logs / "sigterm_drill.log").read_text()
    drill = checks["sigterm_drill"]
    assert drill["complete"] == [drill["last_step"]] and drill["last_step"] >= 3 and drill["save_seconds"] > 0

    before = out.read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert again.returncode == 2 and "exists" in again.stderr and out.read_text() == before


def test_without_cuda_it_fails_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "sees no CUDA device" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
