"""Recipes that train: gate_ablation at the tiny scale with two seeds and a CI-sized step
budget, its report (mean ± std per cell, Δ with its noise, the claims table), a failing run
that does not stop the others, and the token-level analysis of two of its checkpoints."""

import json
import math
import os
import re
from html import unescape
from statistics import mean, stdev
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, faults
from gamma_titan.reports.tokens import analyse, delta_sym_p, difficulty_bins

pytestmark = pytest.mark.multiprocess  # each recipe run is a trainer process

STEPS = 20  # per run; the recipe's own budget is 900 steps (20 tokens per parameter)
SEEDS = "0,1"
QUICK = ("--validation.steps", "2")  # 2 batches per evaluation
CELLS = {"g0.5_gatenone": (0.5, "none"), "g0.5_gateelementwise": (0.5, "elementwise"),
         "g1_gatenone": (1.0, "none"), "g1_gateelementwise": (1.0, "elementwise")}


def recipe(*args: str, cwd=REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gamma_titan.cli", "recipe", "run", *args],
                          capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def ablation(tmp_path_factory, builtin_assets):
    out = tmp_path_factory.mktemp("recipe") / "gate_ablation-tiny"
    done = recipe("gate_ablation", "--scale", "tiny", "--steps", str(STEPS), "--seeds", SEEDS, "--out", str(out),
                  "--jobs", "2", *QUICK)  # two at a time: startup (imports, checks) overlaps
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def final_val(out, name) -> float:
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == STEPS
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 5  # step 1 and every quarter
    return val[-1]


def test_tiny_gate_ablation_reports_each_cell_over_its_seeds(ablation):
    out, stdout = ablation
    report = (out / "report" / "report.md").read_text()
    val = {cell: [final_val(out, f"{cell}_s{seed}") for seed in (0, 1)] for cell in CELLS}
    for cell, (gamma, gate) in CELLS.items():
        for seed in (0, 1):  # each seed sets the init and the data order
            config = next((out / f"{cell}_s{seed}" / "runs").glob("*/config.toml")).read_text()
            assert f"init_rate = {gamma}" in config and f'attention_gate = "{gate}"' in config
            assert re.search(rf"^seed = {seed}$", config, re.M) and config.count(f"seed = {seed}") >= 2
    assert val["g1_gatenone"][0] != val["g1_gatenone"][1]  # the seeds differ
    # progress as the runs finish: runs done / total, with an ETA from the planned compute left
    assert re.search(r"runs done: 1/8 \(12%\), \d+:\d\d elapsed, ETA \d+:\d\d", stdout), stdout
    assert re.search(r"runs done: 8/8 \(100%\), \d+:\d\d elapsed, ETA 0:00", stdout), stdout
    assert (out / "g1_gatenone_s0" / "train.log").is_file() and (out / "g1_gatenone_s0" / "console.log").is_file()
    pivot = report.split("**final validation loss**")[1].split("\n\n**")[0]
    assert "(mean ± std over 2 seeds; Δ ± 2 SE, * beyond the noise)" in pivot
    for gamma, cells in ((0.5, ("g0.5_gatenone", "g0.5_gateelementwise")), (1, ("g1_gatenone", "g1_gateelementwise"))):
        a, b = val[cells[0]], val[cells[1]]
        se = math.hypot(stdev(a) / math.sqrt(2), stdev(b) / math.sqrt(2))
        row = (f"| {gamma:g} | {mean(a):.4f} ± {stdev(a):.4f} | {mean(b):.4f} ± {stdev(b):.4f} | "
               f"{mean(b) - mean(a):+.4f} ± {2 * se:.4f} ({abs(mean(b) - mean(a)) / se:.1f} SE)")
        assert row in pivot, (row, pivot)
    claims = report.split("## Claims")[1]
    assert len(re.findall(r"^\| (the gate|…|without the gate)", claims, re.M)) == 4
    assert all(v in ("agrees", "disagrees", "inconclusive") for v in re.findall(r"\*\*(\w+)\*\*", claims))
    assert "8 of 8 runs finished" in report and "fewer than 20 tokens per parameter" in report
    for png in ("loss_curves.png", "final_loss.png", "sink_per_layer.png"):
        assert (out / "report" / png).stat().st_size > 1000
    assert "finished in" in stdout and "## Claims" in stdout


def test_rerun_skips_finished_runs(ablation):
    out, _ = ablation
    before = (out / "g1_gatenone_s0" / "metrics.jsonl").read_text()
    done = recipe("gate_ablation", "--scale", "tiny", "--steps", str(STEPS), "--seeds", SEEDS, "--out", str(out),
                  *QUICK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("finished before, skipped") == 8 and ": training " not in done.stdout
    assert (out / "g1_gatenone_s0" / "metrics.jsonl").read_text() == before
    other = recipe("gate_ablation", "--scale", "tiny", "--steps", "8", "--seeds", SEEDS, "--out", str(out),
                   *QUICK)  # another plan
    assert other.returncode == 2 and "holds recipe gate_ablation at scale tiny with other runs" in other.stderr
    assert (out / "g1_gatenone_s0" / "metrics.jsonl").read_text() == before


def test_a_failed_run_is_reported_and_the_others_go_on(tmp_path, builtin_assets):
    path = tmp_path / "drill.toml"
    # Two runs; the one that loads tests/scripts/fault_injection.py dies at step 3.
    path.write_text('[recipe]\ntitle = "drill"\n[grid]\n"experimental.custom_import" = ["fault_injection", '
                    '"gamma_titan"]\n[report]\nrows = "experimental.custom_import"\n'
                    '[scale.tiny]\ntokens_per_param = 20\nmodels = [{ config = "configs/dense/tiny.toml", '
                    'flavor = "tiny-32" }]\n[scale.paper]\ntokens = 1e9\nmodels = ["configs/dense/tiny.toml"]\n')
    out = tmp_path / "out"
    done = recipe(str(path), "--scale", "tiny", "--steps", "8", "--seeds", "0", "--out", str(out), "--jobs", "2", *QUICK,
                  env=faults(kill_at_step=3))
    assert done.returncode == 1
    assert re.search(r"custom_importfault_injection_s0: FAILED \(exit -?\d+\)", done.stdout), done.stdout
    assert "custom_importgamma_titan_s0: finished" in done.stdout and "1 of 2 runs failed" in done.stdout
    report = (out / "report" / "report.md").read_text()
    assert "1 of 2 runs finished" in report and "failed (exit" in report


def test_token_analysis_of_two_checkpoints(ablation, tmp_path):
    out, _ = ablation
    small = out / "g1_gateelementwise_s0" / "checkpoint" / f"step-{STEPS}"
    std = out / "g0.5_gateelementwise_s0" / "checkpoint" / f"step-{STEPS}"
    report = tmp_path / "tokens"
    cli = [sys.executable, "-m", "gamma_titan.cli", "report", "tokens", str(small), str(std), "--tokens", "5000",
           "--out", str(report)]
    done = subprocess.run([*cli, "--text", "def f(x):\n    return x ** 2  # the square of x"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads((report / "tokens.json").read_text())
    n = result["tokens"]
    assert n == (5000 - 1) // 128 * 128  # whole windows of the training seq_len
    hist = result["delta_sym_p"]["histogram"]
    assert sum(hist["counts"]) == n and hist["edges"][0] == -1.0 and hist["edges"][-1] == 1.0
    bins = result["difficulty_bins"]
    assert len(bins) == 10 and sum(b["count"] for b in bins) == n
    assert max(b["count"] for b in bins) - min(b["count"] for b in bins) <= 1
    assert all(a["difficulty_max"] <= b["difficulty_min"] for a, b in zip(bins, bins[1:]))
    # the mean gain over the bins, weighted by size, is the overall gain
    assert sum(b["gain_mean"] * b["count"] for b in bins) / n == pytest.approx(result["gain_mean"], abs=1e-9)
    paired = result["paired"]  # the same windows of both models: a difference's spread, below each model's own
    assert paired["seq_len"] == 128 and paired["sequences"] == n // 128
    assert paired["stderr"] == pytest.approx(paired["std"] / np.sqrt(paired["sequences"]))
    assert 0 < paired["std"] < max(paired["own_std_small"], paired["own_std_std"])
    assert f"Paired over {paired['sequences']} sequences of 128 tokens" in (report / "summary.md").read_text()
    html = (report / "tokens.html").read_text()
    assert html.count("<span style=\"background: rgba(") == len(re.findall(r"title=\"gain [+-]", html)) > 5
    shown = unescape(re.sub(r"<[^>]+>", "", html.split("<pre>")[1].split("</pre>")[0]))
    assert shown.endswith("return x ** 2  # the square of x")  # every token after the first, in order
    for name in ("delta_sym_p.png", "gain_by_difficulty.png", "summary.md"):
        assert (report / name).stat().st_size > 100
    again = subprocess.run(cli, capture_output=True, text=True, cwd=REPO)  # never overwrites by default
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_token_analysis_definitions_against_a_naive_loop():
    rng = np.random.default_rng(1)
    loss_small, loss_std = rng.exponential(2.0, 1003), rng.exponential(2.0, 1003)
    p_s, p_t = np.exp(-loss_small), np.exp(-loss_std)
    dsym = delta_sym_p(p_s, p_t)
    for i in range(0, 1003, 97):
        assert dsym[i] == pytest.approx((p_s[i] - p_t[i]) / (p_s[i] + p_t[i]))
    assert np.all(np.abs(dsym) <= 1) and np.allclose(delta_sym_p(p_t, p_s), -dsym)
    bins = difficulty_bins(loss_small, loss_std)
    order = sorted(range(1003), key=lambda i: (loss_small[i] + loss_std[i]) / 2)
    sizes = [101, 101, 101, 100, 100, 100, 100, 100, 100, 100]
    start = 0
    for b, size in zip(bins, sizes):
        idx = order[start:start + size]
        start += size
        assert b["count"] == size
        assert b["gain_mean"] == pytest.approx(np.mean([loss_std[i] - loss_small[i] for i in idx]))
    # the paired spread: sequences of 100 tokens (the last 3 tokens are no whole sequence)
    paired = analyse(loss_small, loss_std, seq_len=100)["paired"]
    means = [np.mean([loss_std[i] - loss_small[i] for i in range(k * 100, k * 100 + 100)]) for k in range(10)]
    assert paired["sequences"] == 10 and paired["std"] == pytest.approx(np.std(means, ddof=1))
    assert paired["stderr"] == pytest.approx(np.std(means, ddof=1) / np.sqrt(10))
    own = [np.mean(loss_small[k * 100:k * 100 + 100]) for k in range(10)]
    assert paired["own_std_small"] == pytest.approx(np.std(own, ddof=1))
    assert "paired" not in analyse(loss_small, loss_std)


def test_a_mixture_validates_each_source_and_their_token_weighted_mean_is_the_total(ablation):
    """The tiny config validates on its docs + code mixture: each validation logs each
    source's loss (val_loss/<source>), and the total is their mean weighted by each source's
    tokens in the validation set (run.json's reads: sequences per source, seq_len each)."""
    out, _ = ablation
    run = out / "g1_gatenone_s0"
    held = json.loads(next((run / "runs").glob("*/run.json")).read_text())["reads"]["validation_set"]
    assert set(held["per_source"]) == {"docs", "code"} and all(n > 0 for n in held["per_source"].values())
    assert sum(held["per_source"].values()) == held["sequences"] == 2 * 32  # validation.steps x local batch
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in records if "val_loss" in r]
    assert len(validated) == 5
    for r in validated:
        weighted = sum(n * r[f"val_loss/{name}"] for name, n in held["per_source"].items()) / held["sequences"]
        assert r["val_loss"] == pytest.approx(weighted, rel=1e-6), r
        assert r["val_loss/docs"] != r["val_loss/code"]  # two measurements, not one copied
