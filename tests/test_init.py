"""γ-init: every weight's std is d_in^(−γ), norms start at 1, overrides and truncation
work, and `inspect`'s block-by-block init is the trainer's init."""

import math

import pytest
import torch

from helpers import small_args
from gamma_titan.init import draw, ParamInit, param_seed
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models.dense import GammaDense
from gamma_titan.train_specs import TRAIN_SPECS

# Every matrix has >= 4096 entries, so a 5% band is > 4 standard errors of the std.
SHAPE = dict(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1024, vocab_size=1024)


def build(args, seed=0):
    args.init.seed = seed
    with torch.device("meta"):
        model = GammaDense(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def expected_fan_in(name: str, shape) -> int:
    # Written out per weight, independently of the model's rule.
    if name.endswith("feed_forward.w2.weight"):
        return SHAPE["ffn_hidden_dim"]
    if name.endswith("attention.wo.weight"):
        return SHAPE["dim"]  # n_heads * head_dim
    return SHAPE["dim"]  # embedding rows, q/k/v/gate/w1/w3/output all read the width


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_measured_std_matches_fan_in_rule(gamma, gate):
    model = build(small_args(gamma, gate, **SHAPE))
    seen = set()
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        target = expected_fan_in(name, p.shape) ** -gamma
        std = p.float().std().item()
        assert abs(std / target - 1) < 0.05, (name, std, target)
        assert abs(p.float().mean().item()) < 0.1 * target, name
        seen.add(name.split(".")[-2])
    assert {"tok_embeddings", "wq", "wk", "wv", "wo", "gate_proj", "w1", "w2", "w3", "output"} <= seen


def test_gate_shapes():
    head = build(small_args(gate="headwise", **SHAPE))
    elem = build(small_args(gate="elementwise", **SHAPE))
    none = build(small_args(gate="none", **SHAPE))
    assert head.layers["0"].attention.gate_proj.weight.shape == (8, 512)
    assert elem.layers["0"].attention.gate_proj.weight.shape == (8 * 64, 512)
    assert not hasattr(none.layers["0"].attention, "gate_proj")
    gated_keys = {k for k in elem.state_dict() if "gate_proj" not in k}
    assert set(none.state_dict()) == gated_keys


def test_per_group_override():
    args = small_args(1.0, **SHAPE)
    args.init.rate_overrides = {"output": 0.5, "embedding": 0.75}
    model = build(args)
    d = SHAPE["dim"]
    assert abs(model.output.weight.std().item() / d**-0.5 - 1) < 0.05
    assert abs(model.tok_embeddings.weight.std().item() / d**-0.75 - 1) < 0.05
    assert abs(model.layers["0"].attention.wq.weight.std().item() / d**-1.0 - 1) < 0.05


def test_truncation_cuts_tails():
    entry = ParamInit("w", "ffn", 256, 1.0)
    plain = draw(entry, (512, 256), seed=0, device="cpu")
    cut = draw(entry, (512, 256), seed=0, device="cpu", truncation=2.0)
    sigma = 256**-1.0
    assert plain.abs().max() > 3 * sigma
    assert cut.abs().max() <= 2 * sigma + 1e-12
    # std of N(0, 1) truncated at ±2 is 0.8796
    assert abs(cut.std().item() / (0.8796 * sigma) - 1) < 0.02


def test_seed_is_per_parameter_and_stable():
    assert param_seed(0, "a") == param_seed(0, "a")
    assert len({param_seed(0, "a"), param_seed(0, "b"), param_seed(1, "a")}) == 3
    a = build(small_args(**SHAPE), seed=3)
    b = build(small_args(**SHAPE), seed=3)
    c = build(small_args(**SHAPE), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.output.weight, c.output.weight)


def test_inspect_block_by_block_init_equals_trainer_init():
    args = small_args(1.0, "headwise", **SHAPE)
    report = inspect_model(TRAIN_SPECS["gamma_dense"], args, seq_len=64, seed=7)
    model = build(small_args(1.0, "headwise", **SHAPE), seed=7)
    params = dict(model.named_parameters())
    assert [r["name"] for r in report["params"]] == list(params)
    for row in report["params"]:
        p = params[row["name"]].float()
        if row["target_std"] is not None:
            assert row["std"] == p.std().item(), row["name"]
            assert row["fan_in"] == expected_fan_in(row["name"], p.shape)
            assert math.isclose(row["target_std"], row["fan_in"] ** -1.0)
