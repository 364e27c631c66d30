"""tools/gpu_check.sh, the GPU acceptance check, in its --dry-run mode on the CPU: every
check runs through the real CLI at debug shapes and prints its PASS line with a figure,
and the JSON report holds the numbers behind each line."""

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.multiprocess

CHECKS = ["kernels", "inspect_moe", "dense_bf16", "moe_mla_bf16", "dense_float8", "sigterm_drill"]
TWO_GPU = ["titan_cp2", "qwen3_tp2", "deepseek_ep2"]  # skipped without 2 GPUs


def test_dry_run_passes_every_check_and_never_overwrites(tmp_path, builtin_assets):
    out = tmp_path / "gpu_check.json"
    cmd = ["bash", str(REPO / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert [line.split()[1] for line in lines] == [*CHECKS, *TWO_GPU]
    assert all(line.startswith("PASS ") for line in lines[:-3])
    # context parallelism and qwen3's TP need 2 GPUs (no DTensor rule for the CPU's SDPA
    # kernels), and so does TorchTitan's expert parallelism (a Triton kernel): skipped, not failed
    assert lines[-3:] == [f"SKIP  {name:<14} needs 2 CUDA devices, a CPU here" for name in TWO_GPU]
    assert "6/6 passed (3 skipped)" in proc.stdout

    report = json.loads(out.read_text())
    assert report["dry_run"] and report["passed"] and list(report["checks"]) == [*CHECKS, *TWO_GPU]
    for name in TWO_GPU:
        assert report["checks"][name] == {"passed": None, "figure": "needs 2 CUDA devices, a CPU here",
                                          "skipped": True}
    checks = report["checks"]
    assert set(checks["kernels"]["kernels"]) == {"dense/debug mha", "moe/debug mha", "moe/debug_mla mla"}
    assert checks["kernels"]["kernels"]["dense/debug mha"]["kernel"] == "flash_cpu"
    assert checks["inspect_moe"]["inspected"] == ["dense/debug", "moe/debug", "moe/debug_mla"]
    # Step 1 at γ = 1: the output head's logits are N(0, 1/d) over V tokens, so the loss is
    # ln V + 1/(2d) (d 256, V 4096 for both debug models), up to the batch's sampling noise:
    # at most 1.1e-3 relative over 15 measured batches of the init models.
    first_loss = math.log(4096) + 1 / (2 * 256)
    for name in ("dense_bf16", "moe_mla_bf16", "dense_float8"):
        c = checks[name]
        assert c["exit"] == 0 and c["steps"] == 3 and c["graph_breaks"] == 0
        assert c["tokens_per_s"] > 0 and c["peak_active_gib"] > 0
        assert len(c["losses"]) == 3 and c["final_loss"] == c["losses"][-1]
        assert c["first_loss_expected"] == pytest.approx(first_loss, rel=1e-12)
        assert c["losses"][0] == pytest.approx(first_loss, rel=3e-3)
    # float8 (emulated) against the fp32 run of the same settings, step by step: measured
    # 9.2e-5 (7.3e-6, 5.4e-5, 9.2e-5 by step); 5e-4 leaves a margin of 5.4. The check holds
    # it to the same bound (its loss_rtol) and reports the difference it found.
    float8, reference = checks["dense_float8"], checks["dense_bf16"]
    assert float8["losses"] == pytest.approx(reference["losses"], rel=5e-4)
    assert float8["losses"] != reference["losses"]  # float8 did change the numbers
    assert float8["loss_rel_diff_vs_dense_bf16"] == pytest.approx(
        max(abs(a - b) / b for a, b in zip(float8["losses"], reference["losses"])), rel=1e-9)
    assert float8["loss_rtol"] == 5e-4
    logs = tmp_path / "gpu_check_logs"
    assert "Swapped to Float8Linear" in (logs / "dense_float8.log").read_text()
    # the start-up log names each attention kind's kernel, the math one as a warning
    assert "WARNING - attention mla: SDPA kernel math" in (logs / "moe_mla_bf16.log").read_text()
    assert "attention mha: SDPA kernel flash_cpu" in (logs / "dense_bf16.log").read_text()
    assert "--shutdown-timeout=360" in (logs / "sigterm_drill.log").read_text()
    drill = checks["sigterm_drill"]
    assert drill["complete"] == [drill["last_step"]] and drill["last_step"] >= 3 and drill["save_seconds"] > 0

    before = out.read_text()
    # the refusal is gpu_check.py's own (the script above handed it --out): asked directly, it
    # answers before any import, where the script's pre-flight imports cost ~10 s
    again = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), *cmd[2:]],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert again.returncode == 2 and "exists" in again.stderr and out.read_text() == before


def test_the_loss_checks_fail_on_a_wrong_loss(monkeypatch):
    """gpu_check's loss references, without a run: step 1 from the shapes (the 1.5B and
    3B-A0.5B-mla GPU configs: γ = 1, V 50304, d 2048 and 1536), and the float8 comparison,
    which fails a float8 run that stops training, or has fewer losses than its reference."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # for its dataclasses
    spec.loader.exec_module(gpu_check)
    assert gpu_check.first_step_loss("configs/dense/1.5B.toml") == pytest.approx(math.log(50304) + 1 / 4096,
                                                                                rel=1e-12)
    assert gpu_check.first_step_loss("configs/moe/3B-A0.5B.toml", "--model.flavor", "3B-A0.5B-mla") == \
        pytest.approx(math.log(50304) + 1 / 3072, rel=1e-12)

    def float8(losses):
        check = gpu_check.Check("dense_float8", True, "", {"losses": losses})
        reference = gpu_check.Check("dense_bf16", True, "", {"losses": [10.83, 10.2, 9.1]})
        return gpu_check.compare_losses(check, reference, 5e-4)

    assert float8([10.83, 10.2, 9.104]).passed
    stuck = float8([10.83, 10.8, 10.8])
    assert not stuck.passed and stuck.details["loss_rel_diff_vs_dense_bf16"] == pytest.approx(1.7 / 9.1)
    assert not float8([10.83]).passed and "no losses to compare" in float8([10.83]).figure


def test_without_cuda_it_fails_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "sees no CUDA device" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
