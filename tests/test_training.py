"""End-to-end runs of the debug model on CPU: loss falls, logs are written, and the
torch.compile and float8 (emulated) paths run."""

import json

import pytest

from helpers import read_metrics, run_trainer

pytestmark = pytest.mark.multiprocess


def test_debug_run_loss_falls_and_logs(tmp_path, builtin_assets):
    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "30", "--metrics.log_freq", "5",
                "--validation.freq", "30", "--validation.steps", "4")
    records = read_metrics(dump)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30]
    for r in train:
        assert {"step", "loss", "grad_norm", "lr", "tps"} <= set(r)
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [1, 30]  # merged into the training line of that step
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    events = list((dump / "tb").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_metrics_file_is_appended_not_overwritten(tmp_path, builtin_assets):
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "metrics.jsonl").write_text(json.dumps({"step": 0, "note": "earlier run"}) + "\n")
    run_trainer(dump, "--training.steps", "2", "--metrics.log_freq", "1",
                "--validation.enable", "false", "--metrics.enable_tensorboard", "false")
    records = read_metrics(dump)
    assert records[0] == {"step": 0, "note": "earlier run"}
    assert [r["step"] for r in records[1:]] == [1, 2]


@pytest.mark.parametrize("variant", ["compile", "float8"])
def test_compile_and_float8_run_three_steps(tmp_path, variant, builtin_assets):
    extra = {
        "compile": ("--compile.enable", "true"),
        "float8": ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", "true",
                   "--quantize.linear.float8.filter_fqns", "output"),
    }[variant]
    dump = tmp_path / variant
    proc = run_trainer(dump, "--training.steps", "3", "--metrics.log_freq", "1",
                       "--validation.enable", "false", "--metrics.enable_tensorboard", "false", *extra)
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 3 and all(l == l and l < 9 for l in losses)  # finite, sane
    log = proc.stdout + proc.stderr
    assert ("Compiling each TransformerBlock" in log) if variant == "compile" else ("Swapped to Float8Linear" in log)
