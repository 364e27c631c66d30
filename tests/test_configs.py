"""Every shipped config parses, passes the pre-flight checks for an 8-GPU node, and builds
its flavor with the parameter count its modules hold and the README's table lists; every
flavor of every family of ours is counted from its built modules, against the args' own
counts and, where a family has one, a count written out from its shapes (SHAPE_COUNTS).
The README's flavor tables are tools/readme_tables.py's, from the registry."""

import inspect
import re
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import REPO
from gamma_titan.config import load_job_config
from gamma_titan.inspect_model import inspect_model
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.models.common import ATTENTION_GATES
from gamma_titan.models.common.args import GammaArgs
from gamma_titan.models.common.decoder import DecoderLM
from gamma_titan.training.preflight import preflight

sys.path.insert(0, str(REPO / "tools"))
import readme_tables  # noqa: E402  (tools/readme_tables.py: the README's generated sections)

#: Our own families (the decoder's); TorchTitan's (titan/) are tested in test_titan*.py.
OURS = [name for name, spec in TRAIN_SPECS.items() if issubclass(spec.model_cls, DecoderLM)]


def config_model(path: Path) -> str:
    return tomllib.loads(path.read_text())["model"]["name"]


#: Every config but those of TorchTitan's families (one naming no registered model fails pre-flight here).
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.toml") if config_model(p) not in set(TRAIN_SPECS) - set(OURS))
IDS = [f"{p.parent.name}/{p.stem}" for p in CONFIGS]


def mha_counts(args) -> tuple[int, int, int]:
    """(matmul weights, norm scales, value width per head) of one block's multi-head
    (grouped-query) attention: wq and wo d·H·head_dim each, wk and wv d·KV·head_dim each."""
    d, heads = args.dim, args.n_heads
    head_dim = d // heads
    kv_heads = heads if args.n_kv_heads is None else args.n_kv_heads
    return 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim, 0, head_dim


def mla_counts(args) -> tuple[int, int, int]:
    """The same for multi-head latent attention: wq (or wq_a, q_norm, wq_b), wkv_a, kv_norm,
    wkv_b, wo."""
    d, heads, rank = args.dim, args.n_heads, args.q_lora_rank
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    query = d * heads * qk if rank == 0 else d * rank + rank * heads * qk
    matmul = (query + d * (args.kv_lora_rank + args.qk_rope_head_dim)
              + args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim) + heads * args.v_head_dim * d)
    return matmul, args.kv_lora_rank + rank, args.v_head_dim  # kv_norm, q_norm (rank > 0)


def gate_count(args, value_dim: int) -> int:
    """The attention gate: none 0, headwise d·H, elementwise d·H·value head dim."""
    return {"none": 0, "headwise": args.dim * args.n_heads, "elementwise": args.dim * args.n_heads * value_dim}[
        args.attention_gate]


def dense_counts(args) -> dict[str, int]:
    """gamma_dense by its shapes alone: "total" (every parameter) and "matmul" (all but the
    embedding rows and the norm scales). Per block: the attention, the gate, two norms and a
    SwiGLU 3·d·ffn; then the final norm and the output d·V."""
    d, vocab, layers = args.dim, args.vocab_size, args.n_layers
    attention, _, value_dim = mha_counts(args)
    matmul = layers * (attention + gate_count(args, value_dim) + 3 * d * args.ffn_hidden_dim) + d * vocab
    return {"total": vocab * d + layers * 2 * d + d + matmul, "matmul": matmul}


def moe_counts(args) -> dict[str, int]:
    """gamma_moe by its shapes alone: as gamma_dense's, with MHA or MLA, n_dense_layers
    SwiGLU blocks and the rest MoE layers (routed and shared experts 3·d·moe_hidden each, the
    router d·E; the expert bias is a buffer), and "active" (the matmul weights one token
    passes through: top_k of the routed experts)."""
    d, vocab, layers = args.dim, args.vocab_size, args.n_layers
    attention, attention_norms, value_dim = (mla_counts if args.attention == "mla" else mha_counts)(args)
    moe_layers = layers - args.n_dense_layers
    expert = 3 * d * args.moe_hidden_dim
    moe = (args.n_routed_experts + args.n_shared_experts) * expert + d * args.n_routed_experts
    matmul = (layers * (attention + gate_count(args, value_dim)) + args.n_dense_layers * 3 * d * args.ffn_hidden_dim
              + moe_layers * moe + d * vocab)
    return {"total": vocab * d + layers * (2 * d + attention_norms) + d + matmul, "matmul": matmul,
            "active": matmul - moe_layers * (args.n_routed_experts - args.top_k) * expert}


#: Families with a count written out from their shapes: a reference that does not share
#: the args' code. A family without one is still checked against its built modules.
SHAPE_COUNTS = {"gamma_dense": dense_counts, "gamma_moe": moe_counts}


def built_counts(model) -> dict[str, int]:
    """A built decoder's parameters, counted part by part (the token embedding, each block,
    the final norm, the output) from the modules that hold them: "embedding", "norm" (the
    scales of the norm layers), "matmul" (the rest) and "total". Fails on a parameter outside
    those parts, or on a vector outside a norm: the decoder has no biases (MoE's expert bias
    is a buffer)."""
    parts = [("tok_embeddings", model.tok_embeddings),
             *((f"layers.{i}", block) for i, block in model.layers.named_children()),
             ("norm", model.norm), ("output", model.output)]
    counts = dict.fromkeys(("embedding", "norm", "matmul"), 0)
    for prefix, part in parts:
        for name, module in part.named_modules(prefix=prefix):
            for key, param in module.named_parameters(recurse=False):
                if module is model.tok_embeddings:
                    counts["embedding"] += param.numel()
                elif "Norm" in type(module).__name__:
                    counts["norm"] += param.numel()
                else:
                    assert param.dim() >= 2, f"{name}.{key}: a vector outside a norm (the decoder has no biases)"
                    counts["matmul"] += param.numel()
    counts["total"] = sum(counts.values())
    assert counts["total"] == sum(p.numel() for p in model.parameters()), \
        "parameters outside the embedding, the blocks, the final norm and the output"
    return counts


def readme_lines() -> list[str]:
    return (REPO / "README.md").read_text(encoding="utf-8").split("\n")


def readme_flavor_tables() -> dict[str, list[list[str]]]:
    """{family: the cells of its README flavor table, header first} for each table the README
    has: the table right under a line `<!-- flavors: NAME ... -->`."""
    lines, tables = readme_lines(), {}
    for i, line in enumerate(lines):
        if marker := readme_tables.MARKER.match(line):
            rows = []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            assert len(rows) > 2 and rows[0][0] == "flavor", f"README.md: no `| flavor |` table right under {line}"
            tables[marker[1]] = [rows[0], *rows[2:]]
    return tables


#: The families with a flavor table in the README (optional: see its "Adding a model family").
TABLED = sorted(readme_flavor_tables())


def readme_table(model: str) -> list[list[str]]:
    """The cells of README.md's flavor table of `model`, header first."""
    tables = readme_flavor_tables()
    assert model in tables, f"README.md has no flavor table for {model}"
    return tables[model]


def readme_total(model: str, flavor: str, header: str | None = None) -> tuple[float, float]:
    """The number README.md's flavor table of `model` lists for `flavor` in the column whose
    header starts with `header` (default: the total parameter count, headed "params..." or
    "total..."), and half a unit of its last digit: ("5.3M" -> (5.3e6, 0.05e6), "0.27" ->
    (0.27, 0.005))."""
    head, *rows = readme_table(model)
    prefixes = (header,) if header else ("params", "total")
    columns = [i for i, title in enumerate(head) if title.startswith(prefixes)]
    assert len(columns) == 1, f"README.md's {model} table has {len(columns)} columns headed {' or '.join(prefixes)}"
    for cells in rows:
        if cells[0] == flavor:
            text = cells[columns[0]]
            number, unit = (text[:-1], {"k": 1e3, "M": 1e6, "B": 1e9}[text[-1]]) if text[-1].isalpha() else (text, 1)
            decimals = len(number.partition(".")[2])
            return float(number) * unit, 0.5 * 10 ** -decimals * unit
    raise AssertionError(f"README.md lists no {model} flavor {flavor!r}")


def test_the_readme_flavor_tables_are_the_generators():
    """Each flavor table of the README is what tools/readme_tables.py writes from the
    registry (only the package's own families have one); after a change of flavors the test
    names the command that rewrites them."""
    lines = readme_lines()
    families = readme_tables.own_families()
    assert set(TABLED) <= set(families), f"README.md has flavor tables of families the package does not hold: " \
                                        f"{sorted(set(TABLED) - set(families))}"
    assert {"gamma_dense", "gamma_moe"} <= set(TABLED)
    written = readme_tables.write_flavor_tables(lines, families)
    assert written == lines, f"README.md's flavor tables are stale: run {readme_tables.COMMAND}\n" + \
        readme_tables.diff("\n".join(lines), "\n".join(written))


def test_the_generated_counts_are_written_to_three_digits():
    assert [readme_tables.count(n) for n in (512, 61_584, 5_305_600, 67_600_000, 168_700_000, 15_820_000_000)] == \
        ["512", "61.6k", "5.31M", "67.6M", "0.169B", "15.8B"]
    assert [readme_tables.significant(x) for x in (0.050_71, 0.2799, 17.094, 9.9996, 43.62)] == \
        ["0.0507", "0.280", "17.1", "10.0", "43.6"]


def _meta_model(spec, args):
    import torch

    with torch.device("meta"):
        return spec.model_cls(args)


FLAVORS = [(model, flavor, gate) for model in OURS for flavor in TRAIN_SPECS[model].model_args
           for gate in ATTENTION_GATES]


@pytest.mark.parametrize("model, flavor, gate", FLAVORS,
                         ids=[f"{m.removeprefix('gamma_')}-{f}-{g}" for m, f, g in FLAVORS])
def test_parameter_counts_follow_from_the_shapes(model, flavor, gate):
    """Every flavor of every family of ours, at every gate, built on the meta device: the
    args' own counts (matmul_params, active_params, the FLOPs a token costs before attention)
    are the built modules', and so are the counts written out from the shapes where the family
    has them. What the args say is what inspect, MFU and the README report."""
    spec = TRAIN_SPECS[model]
    args = spec.model_args[flavor]
    args.attention_gate = gate
    counts = built_counts(_meta_model(spec, args))
    active = args.active_params()  # None: every matmul weight is active
    assert active is None or 0 < active <= counts["matmul"]
    if hasattr(args, "matmul_params"):
        every = {"active": False} if "active" in inspect.signature(args.matmul_params).parameters else {}
        assert args.matmul_params(**every) == counts["matmul"]
    if type(args).flops_per_token is not GammaArgs.flops_per_token:
        assert args.flops_per_token(0) == 6 * (counts["matmul"] if active is None else active)  # 2 forward, 4 backward
    if model in SHAPE_COUNTS:
        expected = SHAPE_COUNTS[model](args)
        assert (counts["total"], counts["matmul"], active) == (expected["total"], expected["matmul"],
                                                               expected.get("active"))


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_passes_preflight(path: Path, builtin_assets):
    config = load_job_config(["--job.config_file", str(path)])
    spec, args = preflight(config, world_size=1 if config.model.flavor.startswith(("debug", "tiny")) else 8)
    report = inspect_model(spec, args, config.training.seq_len, measure=False)
    assert report["n_params"] == built_counts(_meta_model(spec, args))["total"]
    if config.model.name in SHAPE_COUNTS:
        assert report["n_params"] == SHAPE_COUNTS[config.model.name](args)["total"]
    if config.model.name in TABLED:
        listed, half_digit = readme_total(config.model.name, config.model.flavor)
        assert abs(report["n_params"] - listed) <= half_digit, (report["n_params"], listed)  # the README's rounding
    assert config.gamma.init_rate == 1.0 and config.gamma.norm_eps == 1e-12
    assert config.gamma.attention_gate == "elementwise"


#: (family, flavor) for each family with a README flavor table: it lists every flavor.
LISTED = [(model, flavor) for model in TABLED for flavor in TRAIN_SPECS[model].model_args]


@pytest.mark.parametrize("model, flavor", LISTED, ids=[f"{m.removeprefix('gamma_')}-{f}" for m, f in LISTED])
def test_the_readme_tables_list_every_flavor(model, flavor):
    """A family's README flavor table (under `<!-- flavors: NAME -->`) lists every flavor: the
    total is the built model's with the configs' elementwise gate; a column headed "active"
    is `active_params` (what inspect prints), one headed "GFLOP/token (seq N)" the training
    FLOPs at seq N; each to its printed rounding, and each field column the flavor's value
    (or an empty cell)."""
    spec = TRAIN_SPECS[model]
    args = spec.model_args[flavor]
    args.attention_gate = "elementwise"
    total = built_counts(_meta_model(spec, args))["total"]
    listed, half = readme_total(model, flavor)
    assert abs(total - listed) <= half, (total, listed)
    for title in readme_table(model)[0]:
        if title.startswith("active"):
            value = args.active_params()
        elif seq := re.fullmatch(r"GFLOP/token \(seq (\d+)\)", title):
            value = args.flops_per_token(int(seq[1])) / 1e9
        else:
            continue
        listed, half = readme_total(model, flavor, title)
        assert abs(value - listed) <= half, (title, value, listed)
    head, *rows = readme_table(model)
    cells = dict(zip(head, next(row for row in rows if row[0] == flavor)))
    for name in set(head) & set(args.model_args_fields()):
        assert cells[name] in ("", readme_tables.field_cell(getattr(args, name))), (name, cells[name])


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
        assert p.expert_parallel_degree == (1 if args.expert_parallel_divisor() == 1 else min(gpus, 8))  # 1: no experts
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
