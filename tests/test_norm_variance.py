"""The variance each RMSNorm sees at init, measured on the built model
(models/common/norm_inputs.py), and the recipe planner's ε check that reads it. A family
with post-norms (tests/families/sandwich_block) is the case a pre-norm assumption got
wrong: its post-norms see a sublayer's output, ~500x below the embedding's d^(−2γ) at
γ = 1, so ε = 1e-5 dominates them at width 64, where it is negligible at a pre-norm."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from helpers import DEBUG_TOML, REPO
from families.sandwich_block import NAME as SANDWICH
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models.common.norm_inputs import PROBE_VOCAB, norm_inputs_at_init, probe_seed, probe_tokens
from gamma_titan.recipes.run import execute, plan_recipe
from gamma_titan.training.train_spec import resolve_model

SANDWICH_ARGV = ("--model.name", SANDWICH, "--model.flavor", "debug", "--gamma.init_rate", "1.0")


def built(argv) -> tuple:
    config = load_job_config(["--job.config_file", str(DEBUG_TOML), *argv])
    spec, args = resolve_model(config)
    return spec, args, config.training.seq_len


def naive_norm_inputs(spec, args, tokens) -> dict[str, float]:
    """σ²(h) at every RMSNorm input of the whole model, initialised by its own
    init_weights (the trainer's call), from forward pre-hooks on one forward pass."""
    args = copy.deepcopy(args)
    args.init.seed = probe_seed(args)  # the walk's seed (unset: the trainer's torch seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    seen = {}
    for name, norm in model.named_modules():
        if isinstance(norm, nn.RMSNorm):
            norm.register_forward_pre_hook(lambda m, inputs, name=name: seen.__setitem__(
                name, inputs[0].pow(2).mean().item()))
    with torch.no_grad():
        model(tokens)
    return seen


@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_the_walk_measures_what_a_forward_hook_measures(eps):
    """The planner's walk (first block only: the fixture's blocks are of one kind) gives the
    hook's numbers at the norms it passes, and the smallest of the whole model."""
    spec, args, seq_len = built([*SANDWICH_ARGV, "--gamma.norm_eps", str(eps)])
    walk = norm_inputs_at_init(spec.model_cls, args, seq_len)
    reference = naive_norm_inputs(spec, args, probe_tokens(min(args.vocab_size, PROBE_VOCAB), seq_len,
                                                           probe_seed(args)))
    assert set(walk.norm_inputs) == {n for n in reference if n.startswith("layers.0.")}
    for name, var in walk.norm_inputs.items():
        assert var == pytest.approx(reference[name], rel=1e-5), name
    site, smallest = walk.smallest()
    assert (site, smallest) == min(reference.items(), key=lambda kv: kv[1])
    assert re.fullmatch(r"layers\.0\.norms\.post_\w+", site)
    embedding = walk.embedding.pow(2).mean().item()
    assert embedding == pytest.approx(args.dim ** -2.0, rel=0.05)  # the pre-norm assumption
    assert smallest < embedding / 300  # a post-norm: ~4.3e-7 against 2.4e-4


def test_inspect_names_the_post_norm_that_eps_dominates():
    spec, args, seq_len = built([*SANDWICH_ARGV, "--gamma.norm_eps", "1e-5"])
    report = inspect_model(spec, args, seq_len)
    assert re.fullmatch(r"layers\.\d\.norms\.post_\w+", report["hidden_var_site"])
    assert report["eps_dominated"] and 1e-5 / report["hidden_var"] > 10
    assert report["hidden_var"] == pytest.approx(norm_inputs_at_init(spec.model_cls, args, seq_len).smallest()[1],
                                                 rel=0.2)  # another probe batch


def plan_printed(tmp_path, capsys, config, flavor: str, eps: float):
    """The dry run of γ ∈ {0.5, 1} at this ε: the runs and what it printed."""
    recipe = tmp_path / f"{config.stem}_{eps}.toml"
    recipe.write_text(f'[recipe]\ntitle = "ε check"\n[set]\n"gamma.norm_eps" = {eps}\n'
                      '[grid]\n"gamma.init_rate" = [0.5, 1.0]\n[scale.tiny]\ntokens = 2e5\nseeds = [0]\n'
                      f'models = [{{ config = "{config}", flavor = "{flavor}" }}]\n')
    planned = plan_recipe(str(recipe), "tiny", out=str(tmp_path / "out"))
    assert execute(planned, dry_run=True) == 0
    return planned.runs, capsys.readouterr().out


def test_the_plan_warns_where_eps_dominates_a_post_norm(builtin_assets, tmp_path, capsys):
    """γ ∈ {0.5, 1} at ε = 1e-5, width 64: the sandwich's post-norms are ε-dominated at γ = 1
    (the plan used to call it negligible: 1e-5 / 64^-2 = 0.04); the pre-norm model of the
    same width is not, and ε = 1e-12 is negligible for both."""
    sandwich = tmp_path / "sandwich.toml"
    sandwich.write_text(DEBUG_TOML.read_text().replace('name = "gamma_dense"', f'name = "{SANDWICH}"'))
    runs, printed = plan_printed(tmp_path, capsys, sandwich, "debug", 1e-5)
    g05, g1 = sorted(runs, key=lambda r: r.values["gamma.init_rate"])
    assert not g05.eps_dominated and g1.eps_dominated and g1.eps_ratio > 10
    assert re.fullmatch(r"layers\.\*\.norms\.post_\w+", g1.hidden_var_site)
    assert (f"ε / σ²(h) at init = 1e-05 / {g1.hidden_var:.3g} = {g1.eps_ratio:.3g} (ε-DOMINATED; σ²(h) at "
            f"{g1.hidden_var_site}, the smallest norm input)") in printed
    assert (f"WARNING: ε = 1e-05 dominates a norm's input at init in 1 of 2 runs (ε/σ²(h) up to "
            f"{g1.eps_ratio:.3g}, run {g1.name}, at {g1.hidden_var_site}: σ²(h) = {g1.hidden_var:.3g})") in printed

    runs, printed = plan_printed(tmp_path, capsys, REPO / "configs/dense/tiny.toml", "tiny-64", 1e-5)
    g1 = max(runs, key=lambda r: r.values["gamma.init_rate"])
    assert g1.hidden_var_site == "layers.*.attention_norm" and g1.hidden_var == pytest.approx(64.0 ** -2, rel=0.05)
    assert 0.03 < g1.eps_ratio < 0.1 and not any(r.eps_dominated for r in runs) and "WARNING" not in printed

    runs, printed = plan_printed(tmp_path, capsys, sandwich, "debug", 1e-12)
    g1 = max(runs, key=lambda r: r.values["gamma.init_rate"])
    assert g1.eps_ratio < 1e-5 and not any(r.eps_dominated for r in runs) and "WARNING" not in printed
    assert (f"ε / σ²(h) at init = 1e-12 / {g1.hidden_var:.3g} = {g1.eps_ratio:.3g} (ε negligible: <= 0.1; σ²(h) "
            f"at {g1.hidden_var_site}, the smallest norm input)") in printed
