"""Every shipped config parses, passes the pre-flight checks for an 8-GPU node, and
builds its flavor with the parameter count that its shapes give (written out below) and
the README's table lists."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import REPO
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.training.preflight import preflight

CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.toml") if p.parent.name != "titan")  # ours (titan: test_titan*.py)
IDS = [f"{p.parent.name}/{p.stem}" for p in CONFIGS]


def param_counts(args) -> dict[str, int]:
    """Parameters by the shapes alone: "total" (every parameter), "matmul" (all but the
    embedding rows and the norm scales) and, for MoE, "active" (the matmul weights one token
    passes through: top_k of the routed experts). Per block: the attention projections
    (MHA/GQA: wq, wk, wv, wo; MLA: wq or wq_a + q_norm + wq_b, wkv_a, kv_norm, wkv_b, wo),
    the gate (none: 0, headwise: d·H, elementwise: d·H·value head dim), two norms, and a
    SwiGLU 3·d·ffn or an MoE layer (routed and shared experts 3·d·moe_hidden each, the
    router d·E; the expert bias is a buffer); then the final norm and the output d·V."""
    d, heads, vocab, layers = args.dim, args.n_heads, args.vocab_size, args.n_layers
    if getattr(args, "attention", "mha") == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        rank = args.q_lora_rank
        query = d * heads * qk if rank == 0 else d * rank + rank * heads * qk
        attention = (query + d * (args.kv_lora_rank + args.qk_rope_head_dim)
                     + args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim)
                     + heads * args.v_head_dim * d)
        attention_norms, value_dim = args.kv_lora_rank + rank, args.v_head_dim  # kv_norm, q_norm (rank > 0)
    else:
        head_dim = d // heads
        kv_heads = heads if args.n_kv_heads is None else args.n_kv_heads
        attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim
        attention_norms, value_dim = 0, head_dim
    gate = {"none": 0, "headwise": d * heads, "elementwise": d * heads * value_dim}[args.attention_gate]
    dense_layers = getattr(args, "n_dense_layers", layers)
    moe_layers = layers - dense_layers
    expert = 3 * d * args.moe_hidden_dim if moe_layers else 0
    moe = (args.n_routed_experts + args.n_shared_experts) * expert + d * args.n_routed_experts if moe_layers else 0
    matmul = layers * (attention + gate) + dense_layers * 3 * d * args.ffn_hidden_dim + moe_layers * moe + d * vocab
    norms = layers * (2 * d + attention_norms) + d
    counts = {"total": vocab * d + norms + matmul, "matmul": matmul}
    if moe_layers:
        counts["active"] = matmul - moe_layers * (args.n_routed_experts - args.top_k) * expert
    return counts


def readme_total(model: str, flavor: str, header: str | None = None) -> tuple[float, float]:
    """The number README.md's flavor table lists for (model, flavor) in the column `header`
    (default: the total parameter count), and half a unit of its last digit: ("5.3M" ->
    (5.3e6, 0.05e6), "0.27" -> (0.27, 0.005)). Rows like "tiny-32 / -48" list several flavors."""
    header = header or ("| params (elementwise gate) |" if model == "gamma_dense" else "| total |")
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| flavor |") and header in line)
    column = [c.strip() for c in lines[start].strip("|").split("|")].index(header.strip("| "))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = cells[0].split(" / ")
        names = [names[0]] + [names[0].rsplit("-", 1)[0] + n if n.startswith("-") else n for n in names[1:]]
        if flavor in names:
            text = cells[column].split(" / ")[names.index(flavor)]
            number, unit = (text[:-1], {"k": 1e3, "M": 1e6, "B": 1e9}[text[-1]]) if text[-1].isalpha() else (text, 1)
            decimals = len(number.partition(".")[2])
            return float(number) * unit, 0.5 * 10 ** -decimals * unit
    raise AssertionError(f"README.md lists no {model} flavor {flavor!r}")


FLAVORS = [(model, flavor, gate) for model in ("gamma_dense", "gamma_moe") for flavor in TRAIN_SPECS[model].model_args
           for gate in ("none", "headwise", "elementwise")
           if gate == "elementwise" or flavor in ("debug", "debug_mla", "1.5B-A0.25B-mla")]


@pytest.mark.parametrize("model, flavor, gate", FLAVORS, ids=[f"{m[6:]}-{f}-{g}" for m, f, g in FLAVORS])
def test_parameter_counts_follow_from_the_shapes(model, flavor, gate):
    """Every flavor (every gate on the debug shapes and on MLA with and without q_lora_rank):
    the model built on the meta device, and the args' own matmul / active counts, equal the
    count written out from the shapes."""
    import torch

    spec = TRAIN_SPECS[model]
    args = spec.model_args[flavor]
    args.attention_gate = gate
    expected = param_counts(args)
    with torch.device("meta"):
        built = spec.model_cls(args)
    assert sum(p.numel() for p in built.parameters()) == expected["total"]
    if model == "gamma_dense":
        assert args.matmul_params() == expected["matmul"]
    else:
        assert args.matmul_params(active=False) == expected["matmul"]
        assert args.active_params() == expected["active"]
        layer = f"layers.{args.n_dense_layers}.moe."
        assert layer + "expert_bias" in dict(built.named_buffers())
        assert layer + "expert_bias" not in dict(built.named_parameters())


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_passes_preflight(path: Path, builtin_assets):
    config = load_job_config(["--job.config_file", str(path)])
    spec, args = preflight(config, world_size=1 if config.model.flavor.startswith(("debug", "tiny")) else 8)
    report = inspect_model(spec, args, config.training.seq_len, measure=False)
    assert report["n_params"] == param_counts(args)["total"]
    listed, half_digit = readme_total(config.model.name, config.model.flavor)
    assert abs(report["n_params"] - listed) <= half_digit, (report["n_params"], listed)  # the README's rounding
    assert config.gamma.init_rate == 1.0 and config.gamma.norm_eps == 1e-12
    assert config.gamma.attention_gate == "elementwise"


MOE_FLAVORS = list(TRAIN_SPECS["gamma_moe"].model_args)


@pytest.mark.parametrize("flavor", MOE_FLAVORS)
def test_the_moe_table_lists_inspects_active_parameters_and_flops(flavor):
    """README's MoE table: the active column is `active_params` (what inspect prints), the
    GFLOP/token column the training FLOPs at seq 2048, each to its printed rounding."""
    args = TRAIN_SPECS["gamma_moe"].model_args[flavor]
    active, half = readme_total("gamma_moe", flavor, "| active (`active_params`) |")
    assert abs(args.active_params() - active) <= half, (args.active_params(), active)
    gflop, half = readme_total("gamma_moe", flavor, "| GFLOP/token (seq 2048) |")
    assert abs(args.flops_per_token(2048) / 1e9 - gflop) <= half, (args.flops_per_token(2048) / 1e9, gflop)


PAPER = [p for p in CONFIGS if not p.stem.startswith(("debug", "tiny", "gpu"))]  # gpu: the recipes' one-GPU scale


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


@pytest.mark.parametrize("config_name", ["dense/7B", "moe/16B-A2.4B"])
def test_the_big_configs_grace_covers_their_save(config_name, builtin_assets):
    """A SIGTERM grace period shorter than a full save (12 bytes a parameter at 1 GB/s per
    node) is warned about before training; the 7B and 16B configs set one that covers it."""
    from gamma_titan.training.launch import save_seconds
    from gamma_titan.training.preflight import launch_warnings

    argv = ["--job.config_file", str(REPO / "configs" / f"{config_name}.toml")]
    config = load_job_config(argv)
    spec, args = preflight(config, world_size=8, local_world_size=8)
    assert config.gamma.reliability.stop_grace_seconds == 600 and launch_warnings(config, args, 8, 8) == []
    short = load_job_config([*argv, "--gamma.reliability.stop_grace_seconds", "60"])
    spec, args = preflight(short, world_size=8, local_world_size=8)
    params = sum(p.numel() for p in _meta_model(spec, args).parameters())
    [warning] = launch_warnings(short, args, 8, 8)
    assert warning.startswith(f"warning: gamma.reliability.stop_grace_seconds = 60 is shorter than a full save of "
                              f"this model ({params / 1e9:.3g}B parameters x 12 bytes at 1 GB/s per node on 1 node: "
                              f"about {save_seconds(params, 1):.0f} s)")
    assert 600 >= 1.5 * save_seconds(params, 1)  # the config's grace, with the plan's headroom


def _meta_model(spec, args):
    import torch

    with torch.device("meta"):
        return spec.model_cls(args)
