"""The paper's laws at init, measured by `inspect`: the residual-flow ratio scales as
d^(1−γ) (Fig. 3a, §2.4), and ε = 1e-5 swamps σ²(h) = d^(−2γ) at γ = 1 (§2.1)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import DEBUG_TOML, REPO, small_args
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models import TRAIN_SPECS

SPEC = TRAIN_SPECS["gamma_dense"]
WIDTHS = (128, 256, 512)


def residual_flow(gamma: float, width: int, seeds=(0, 1)) -> float:
    args = small_args(gamma, dim=width, n_heads=width // 64, n_kv_heads=None,
                      ffn_hidden_dim=(8 * width // 3 + 63) // 64 * 64, vocab_size=512, n_layers=2)
    return float(np.mean([inspect_model(SPEC, args, 128, seed=s)["residual_flow_ratio"] for s in seeds]))


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
def test_residual_flow_ratio_scales_as_d_to_one_minus_gamma(gamma):
    ratios = [residual_flow(gamma, d) for d in WIDTHS]
    slope = np.polyfit(np.log(WIDTHS), np.log(ratios), 1)[0]
    assert abs(slope - (1 - gamma)) <= 0.15, (ratios, slope)


def test_residual_flow_balances_at_gamma_one():
    # γ = 1 is the balance point: the residual stream is neither dominant nor negligible.
    assert residual_flow(0.5, 256) > 5
    assert 0.05 < residual_flow(1.0, 256) < 2
    assert residual_flow(1.5, 256) < 0.05


@pytest.mark.parametrize("eps, dominated", [(1e-5, True), (1e-12, False)])
def test_eps_masking_at_gamma_one_d2048(eps, dominated):
    args = small_args(1.0, eps=eps, dim=2048, n_heads=16, n_kv_heads=None, ffn_hidden_dim=5632,
                      vocab_size=256, n_layers=1)
    report = inspect_model(SPEC, args, 64, probe_len=64)
    # σ²(h) = d^(−2γ) = 2048^−2 ≈ 2.4e-7 at the first norm (the paper's number, §2.1).
    assert report["hidden_var"] == pytest.approx(2048**-2, rel=0.05)
    assert report["hidden_var"] == pytest.approx(2.4e-7, rel=0.05)
    assert report["hidden_var_site"] == "layers.0.attention_norm"  # the embedding (post-norms: test_norm_variance.py)
    assert report["eps_dominated"] is dominated
    assert report["norm_eps"] == eps


def test_inspect_cli_json_has_the_documented_keys():
    out = subprocess.run(
        [sys.executable, "-m", "gamma_titan.cli", "inspect", str(DEBUG_TOML), "--json",
         "--gamma.init_rate", "0.5", "--model_args.n_layers", "2"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    report = json.loads(out)
    for key in ("params", "n_params", "flops_per_token", "hidden_var", "norm_eps",
                "eps_dominated", "residual_flow_ratio"):
        assert key in report
    assert report["init_rate"] == 0.5
    for row in report["params"]:
        assert set(row) >= {"name", "group", "fan_in", "target_std", "std"}
    assert sum(np.prod(r["shape"]) for r in report["params"]) == report["n_params"]
    wq = next(r for r in report["params"] if r["name"] == "layers.0.attention.wq.weight")
    assert wq["fan_in"] == 256 and wq["target_std"] == pytest.approx(256**-0.5)


def test_flops_per_token_counts_gate_and_gqa():
    seq = 256
    counts = {}
    for gate in ("none", "headwise", "elementwise"):
        args = small_args(gate=gate)  # debug: d=256, 4 heads of 64, 2 KV heads, ffn 704
        d, L, V, ffn = 256, 4, 4096, 704
        attn = d * 256 * 2 + d * 128 * 2  # wq, wo; wk, wv have 2 of 4 heads
        gate_p = {"none": 0, "headwise": d * 4, "elementwise": d * 256}[gate]
        expected = 6 * (L * (attn + gate_p + 3 * d * ffn) + d * V) + 6 * L * 4 * 2 * 64 * seq
        counts[gate] = args.flops_per_token(seq)
        assert counts[gate] == expected
    assert counts["none"] < counts["headwise"] < counts["elementwise"]


def test_inspect_prints_sigma2_at_every_norm_site():
    """One line per block with each of its norms (qwen3's q/k norms inside attention
    included), then the norms outside the blocks: every site of the report, its value as
    measured."""
    from gamma_titan.inspect_model import format_report, norm_site_lines

    sites = [{"name": "layers.0.attention_norm", "var": 1.5e-5}, {"name": "layers.0.attention.q_norm", "var": 0.0039},
             {"name": "layers.1.ffn_norm", "var": 2e-5}, {"name": "norm", "var": 1.6e-5}]
    assert norm_site_lines(sites) == ["σ²(h) at every norm input:",
                                      "  layers.0: attention_norm 1.5e-05, attention.q_norm 0.0039",
                                      "  layers.1: ffn_norm 2e-05", "  outside blocks: norm 1.6e-05"]
    from gamma_titan.config import load_job_config
    from gamma_titan.training.train_spec import resolve_model

    spec, args = resolve_model(load_job_config(["--job.config_file", str(REPO / "configs/titan/qwen3_debug.toml")]))
    report = inspect_model(spec, args, 64, probe_len=64)
    text = format_report(report)
    assert len(report["norm_sites"]) == 8 * 4 + 1  # 8 blocks of attention_norm, q_norm, k_norm, ffn_norm; the final norm
    for site in report["norm_sites"]:
        local = site["name"].split(".", 2)[2] if site["name"].startswith("layers.") else site["name"]
        assert f"{local} {site['var']:.2g}" in text
