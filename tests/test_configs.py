"""Every shipped config parses, passes the pre-flight checks for an 8-GPU node, and
builds the flavor the README's table lists."""

from pathlib import Path
from types import SimpleNamespace

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


PAPER = [p for p in CONFIGS if not p.stem.startswith(("debug", "tiny"))]


@pytest.mark.parametrize("path", PAPER, ids=[f"{p.parent.name}/{p.stem}" for p in PAPER])
def test_paper_configs_train_the_same_tokens_per_step_on_any_cluster(path: Path, builtin_assets):
    """Hazard 9: the global batch is pinned, so results do not move with the node count;
    multi-node sizes shard inside a node and replicate across nodes (HSDP); MoE expert
    parallelism is derived from the machine, never more than one node."""
    from gamma_titan.inspect_model import tokens_per_step

    seen = set()
    for nodes, gpus in ((1, 1), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)):
        config = load_job_config(["--job.config_file", str(path)])
        assert config.training.global_batch_size > 0
        if config.training.local_batch_size * nodes * gpus > config.training.global_batch_size:
            continue  # more ranks than the batch has sequences (a pre-flight error, tested below)
        spec, args = preflight(config, world_size=nodes * gpus, local_world_size=gpus)
        seen.add(tokens_per_step(config)["tokens"])
        p = config.parallelism
        shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else nodes * gpus
        hsdp = path.stem not in ("0.1B", "0.3B")  # the single-node sizes shard over every rank
        assert (shard, p.data_parallel_replicate_degree) == ((gpus, nodes) if hsdp else (nodes * gpus, 1))
        experts = getattr(args, "n_routed_experts", None)
        assert p.expert_parallel_degree == (1 if experts is None else min(gpus, 8))
    assert len(seen) == 1


def test_derived_degrees_refuse_what_cannot_work(builtin_assets):
    from gamma_titan.errors import ConfigError

    moe = REPO / "configs" / "moe" / "3B-A0.5B.toml"
    with pytest.raises(ConfigError, match="world size 12 is not a multiple of the GPUs per node"):
        preflight(load_job_config(["--job.config_file", str(moe)]), world_size=12, local_world_size=8)
    config = load_job_config(["--job.config_file", str(moe), "--model_args.n_routed_experts", "6",
                              "--model_args.top_k", "2"])
    preflight(config, world_size=8, local_world_size=8)
    assert config.parallelism.expert_parallel_degree == 2  # gcd(6 experts, 8)
    with pytest.raises(ConfigError, match="training.global_batch_size = 512: must be -1 or a multiple"):
        preflight(load_job_config(["--job.config_file", str(moe)]), world_size=128, local_world_size=8)


FLOAT8_VARIANTS = [("dense/1.5B", gate, None) for gate in ("none", "headwise", "elementwise")] + [
    (f"moe/{flavor}", gate, None) for flavor in ("1.5B-A0.25B", "3B-A0.5B") for gate in ("none", "headwise", "elementwise")
] + [("moe/3B-A0.5B", gate, "3B-A0.5B-mla") for gate in ("none", "headwise", "elementwise")]


@pytest.mark.parametrize("config_name, gate, flavor", FLOAT8_VARIANTS,
                         ids=[f"{c}-{f or ''}-{g}" for c, g, f in FLOAT8_VARIANTS])
def test_float8_keeps_the_head_router_and_headwise_gate_in_high_precision(config_name, gate, flavor,
                                                                         builtin_assets, monkeypatch):
    """Hazard 10: TorchTitan's float8 converter, fed our derived filter, on every variant:
    every linear layer is converted except the output head, the MoE router and the
    headwise gate."""
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    argv = ["--job.config_file", str(REPO / "configs" / f"{config_name}.toml"), "--gamma.attention_gate", gate,
            "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", "true",
            "--compile.enable", "false"]
    config = load_job_config(argv + (["--model.flavor", flavor] if flavor else []))
    spec, args = preflight(config, world_size=8, local_world_size=8)
    with torch.device("meta"):
        model = spec.model_cls(args)
    Float8LinearConverter(config, parallel_dims=SimpleNamespace(dp_shard_enabled=True)).convert(model)
    kept = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, Float8Linear)}
    expected = {"output"}
    expected |= {n for n in kept if n.endswith("moe.router.gate")} if hasattr(args, "n_routed_experts") else set()
    if gate == "headwise":
        expected |= {f"layers.{i}.attention.gate_proj" for i in range(args.n_layers)}
    if hasattr(args, "n_routed_experts"):
        assert {n for n in kept if n.endswith("moe.router.gate")} == {
            f"layers.{i}.moe.router.gate" for i in range(args.n_dense_layers, args.n_layers)}
    assert kept == expected
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert "layers.0.attention.wo" in converted and (gate != "elementwise" or "layers.0.attention.gate_proj" in converted)
