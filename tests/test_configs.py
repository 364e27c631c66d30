"""Every shipped config parses, passes the pre-flight checks for an 8-GPU node, and
builds the flavor the README's table lists."""

from pathlib import Path

import pytest

from helpers import REPO
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model
from gamma_titan.train import preflight

CONFIGS = sorted((REPO / "configs").rglob("*.toml"))
IDS = [f"{p.parent.name}/{p.stem}" for p in CONFIGS]
# (model, flavor): total parameters with the elementwise gate, in millions, as the README lists
README_PARAMS = {
    ("gamma_dense", "debug"): 5.3, ("gamma_dense", "0.1B"): 170, ("gamma_dense", "0.3B"): 440,
    ("gamma_dense", "0.7B"): 890, ("gamma_dense", "1.5B"): 1540, ("gamma_dense", "7B"): 7260,
    ("gamma_moe", "debug"): 6.6, ("gamma_moe", "debug_mla"): 6.0, ("gamma_moe", "1.5B-A0.25B"): 1577,
    ("gamma_moe", "3B-A0.5B"): 2870, ("gamma_moe", "16B-A2.4B"): 15820,
    ("gamma_dense", "tiny-64"): 0.181, ("gamma_moe", "tiny"): 0.249,
}


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_passes_preflight(path: Path, builtin_assets):
    config = load_job_config(["--job.config_file", str(path)])
    spec, args = preflight(config, world_size=1 if config.model.flavor.startswith(("debug", "tiny")) else 8)
    report = inspect_model(spec, args, config.training.seq_len, measure=False)
    expected = README_PARAMS[config.model.name, config.model.flavor] * 1e6
    assert abs(report["n_params"] / expected - 1) < 0.02, report["n_params"]
    assert config.gamma.init_rate == 1.0 and config.gamma.norm_eps == 1e-12
    assert config.gamma.attention_gate == "elementwise"
