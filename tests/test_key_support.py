"""No TorchTitan key accepted and then ignored (gamma_titan/config/key_support.py).

What a run reads is measured where runs train: tests/test_families.py and
tests/test_layouts.py record every key each trainer reads (tests/scripts/key_reads.py) and
check that every key a run sets is read. Here: the keys refused (UNREAD, each family's
unsupported_keys) are refused by pre-flight in one line, and each family key that a family
does not refuse is named in the code its run takes (the matrix turns on only some of them:
activation checkpointing, for one, is off there)."""

import ast
import importlib
import inspect
import typing

import pytest

from gamma_titan.config import load_job_config
from gamma_titan.config.key_support import FAMILY_KEYS, UNREAD
from gamma_titan.config.titan_keys import titan_fields
from gamma_titan.errors import ConfigError
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.training.preflight import preflight
from helpers import REPO, family_debug_config


#: Every registered family, and qwen3's MoE flavor (another run of the same family).
FAMILY_CONFIGS = {name: family_debug_config(name) for name in TRAIN_SPECS} | {
    "qwen3 (MoE)": ("configs/titan/qwen3_debug.toml", ("--model.flavor", "debugmodel_moe"))}


def leaf_is_read(key: str, source: str) -> bool:
    """`.name` of the key's last part in the source (an attribute read of the config)."""
    return f".{key.rsplit('.', 1)[1]}" in source


def reached_source(*roots, depth: int = 5) -> str:
    """The source of `roots` and of every TorchTitan or gamma_titan function and class they
    call (by name, resolved in their module), `depth` calls deep: the code a family's run takes."""
    seen, out, frontier = set(), [], list(roots)
    for _ in range(depth + 1):
        following = []
        for obj in frontier:
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            obj = inspect.unwrap(obj)
            if obj in seen:
                continue
            module = getattr(obj, "__module__", "") or ""
            if not module.startswith(("torchtitan", "gamma_titan")):
                continue
            seen.add(obj)
            try:
                text = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            out.append(text)
            namespace = vars(importlib.import_module(module))
            for node in ast.walk(ast.parse(inspect.cleandoc(text) if text[0].isspace() else text)):
                if isinstance(node, ast.Name) and node.id in namespace:
                    following.append(namespace[node.id])
            if inspect.isclass(obj):
                following += [base for base in obj.__mro__[1:]]
        frontier = following
    return "\n".join(out)


def family(name: str):
    from gamma_titan.models import TRAIN_SPECS
    from gamma_titan.training.train_spec import resolve_model

    config_file, overrides = FAMILY_CONFIGS[name]
    config = load_job_config(["--job.config_file", str(REPO / config_file), *overrides])
    spec, args = resolve_model(config)
    bare = TRAIN_SPECS[config.model.name]
    return config, args, reached_source(bare.parallelize_fn, *([bare.pipelining_fn] if bare.pipelining_fn else []),
                                        bare.model_cls, type(args))


def another_value(key: str, default):
    """A value of the key's type other than TorchTitan's default, that its own rule accepts."""
    special = {"parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["norm", "output"]],
               "parallelism.pipeline_parallel_schedule": "GPipe",
               "parallelism.context_parallel_load_balancer": "ptrr",
               "parallelism.pipeline_parallel_schedule_csv": "schedule.csv",
               "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": ["output"],
               "activation_checkpoint.determinism_check": "none", "model.tokenizer_path": "tokenizer",
               "parallelism.pipeline_parallel_layers_per_stage": 2, "fault_tolerance.process_group": "nccl",
               "fault_tolerance.semi_sync_method": "diloco", "experimental.custom_args_module": "gamma_titan.config"}
    if key in special:
        return special[key]
    kind = titan_fields()[key][0]
    if typing.get_origin(kind) is typing.Literal:
        return next(c for c in typing.get_args(kind) if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default / 2
    raise AssertionError(f"no other value for {key} ({kind}, {default!r})")


def to_flag(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value) if all(isinstance(v, str) for v in value) else repr(value)
    return str(value)


def also_read_by() -> dict:
    """Family keys that TorchTitan's Trainer reads for a family that has the feature."""
    from torchtitan.train import Trainer

    return {"parallelism.context_parallel_load_balancer": Trainer.post_dataloading_process}


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_each_family_reads_its_keys_or_refuses_them(name, tmp_path):
    config, args, source = family(name)
    unsupported = args.unsupported_keys()
    assert set(unsupported) <= set(FAMILY_KEYS)
    also = also_read_by()
    for key in FAMILY_KEYS:
        if key not in unsupported:
            text = source + (inspect.getsource(also[key]) if key in also else "")
            assert leaf_is_read(key, text), f"{name}: nothing in its run reads {key}; read it or refuse it"
    fields = titan_fields()
    for key in list(unsupported) + list(UNREAD):
        value = another_value(key, fields[key][1])
        config_file, overrides = FAMILY_CONFIGS[name]
        section, leaf = key.rsplit(".", 1)
        argv = ["--job.config_file", str(REPO / config_file), *overrides, "--job.dump_folder", str(tmp_path / "run")]
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            toml = tmp_path / "extra.toml"  # a list of lists has no command-line form: a TOML of its own
            toml.write_text((REPO / config_file).read_text() + f"\n[{section}]\n{leaf} = {value!r}\n"
                            if f"[{section}]" not in (REPO / config_file).read_text()
                            else (REPO / config_file).read_text().replace(f"[{section}]\n",
                                                                            f"[{section}]\n{leaf} = {value!r}\n"))
            argv[1] = str(toml)
        else:
            argv += [f"--{key}", to_flag(value)]
        with pytest.raises(ConfigError) as err:
            preflight(load_job_config(argv), world_size=1)
        assert str(err.value).startswith(f"{key} = ") and "does not read it" in str(err.value), (name, key, err.value)


def test_the_keys_this_issue_found_ignored_are_read_or_refused(tmp_path):
    """gamma_moe reads async TP and moe_force_load_balance now; DeepEP, a seed checkpoint
    without checkpoints, pinned-memory async saves, the profiler and memory snapshots on a
    CPU are refused in one line."""
    _, _, moe = family("gamma_moe")
    assert leaf_is_read("parallelism.enable_async_tensor_parallel", moe)
    assert leaf_is_read("debug.moe_force_load_balance", moe)

    def refusal(*overrides: str, config="configs/moe/debug.toml", world=1) -> str:
        with pytest.raises(ConfigError) as err:
            preflight(load_job_config(["--job.config_file", str(REPO / config), "--job.dump_folder",
                                       str(tmp_path / "run"), *overrides]), world_size=world)
        return str(err.value)

    assert refusal("--parallelism.expert_parallel_comm_backend", "deepep").startswith(
        "parallelism.expert_parallel_comm_backend = 'deepep': gamma_moe does not read it (its expert parallelism is "
        "its own all-to-all")
    assert refusal("--checkpoint.create_seed_checkpoint", "true", "--checkpoint.enable", "false") == (
        "checkpoint.create_seed_checkpoint = true writes the seed checkpoint only with checkpoint.enable = true "
        "(without it nothing is written); set both")
    assert refusal("--checkpoint.enable", "true", "--checkpoint.async_mode", "async_with_pinned_mem") == (
        "checkpoint.async_mode = \"async_with_pinned_mem\" stages in pinned CUDA host memory; on this machine use "
        "\"async\" or \"disabled\"")
    assert refusal("--profiling.enable_profiling", "true").startswith(
        "profiling.enable_profiling = true needs a CUDA GPU")
    assert refusal("--profiling.enable_memory_snapshot", "true").startswith(
        "profiling.enable_memory_snapshot = true needs a CUDA GPU")
    assert refusal("--parallelism.enable_async_tensor_parallel", "true").startswith(
        "parallelism.enable_async_tensor_parallel = true applies to tensor parallelism")
    assert refusal("--parallelism.enable_async_tensor_parallel", "true", "--parallelism.tensor_parallel_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "1", world=2).startswith(
        "parallelism.enable_async_tensor_parallel = true needs compile.enable = true")
    assert refusal("--model.tokenizer_path", "somewhere", config="configs/dense/debug.toml").startswith(
        "model.tokenizer_path = 'somewhere': gamma_dense does not read it (TorchTitan deprecated it")


def test_force_load_balance_routes_round_robin():
    """debug.moe_force_load_balance: token t's slot j goes to expert (t·k + j) mod E, so
    every expert takes as many tokens (TorchTitan's benchmarking switch, in our router)."""
    import torch

    from gamma_titan.models.common.moe import TokenChoiceRouter

    router = TokenChoiceRouter(16, 4, 2, "sigmoid", route_norm=True, route_scale=1.0)
    x = torch.randn(6, 16)
    _, free, _ = router(x)
    router.force_load_balance = True
    top, indices, counts = router(x)
    assert indices.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]
    assert counts.tolist() == [3, 3, 3, 3] and not torch.equal(free, indices)
    scores = torch.sigmoid(router.gate(x)).gather(1, indices)
    torch.testing.assert_close(top, scores / scores.sum(dim=-1, keepdim=True))


def test_what_a_key_waits_for():
    """A key that waits for a switch that is off needs no reader (the measured tests in
    test_families.py and test_layouts.py excuse it); switched on, it must be read."""
    from gamma_titan.config.key_support import changed_keys, waiting

    def config(*overrides):
        return load_job_config(["--job.config_file", str(REPO / "configs/dense/debug.toml"), *overrides])

    off = config()
    assert waiting(off, "checkpoint.interval") == "checkpoint.enable = true"
    assert waiting(off, "checkpoint.enable") is None
    assert waiting(off, "quantize.linear.float8.recipe_name") == "model.converters with quantize.linear.float8"
    assert waiting(off, "profiling.profile_freq") == "profiling.enable_profiling = true"
    assert waiting(off, "profiling.save_memory_snapshot_folder") == "profiling.enable_memory_snapshot = true"
    assert waiting(off, "activation_checkpoint.selective_ac_option") == "activation_checkpoint.mode"
    assert waiting(off, "training.steps") is None
    on = config("--checkpoint.enable", "true", "--activation_checkpoint.mode", "full",
                "--model.converters", "quantize.linear.float8")
    for key in ("checkpoint.interval", "activation_checkpoint.selective_ac_option", "quantize.linear.float8.recipe_name"):
        assert waiting(on, key) is None, key
    changed = changed_keys(config("--training.steps", "7"))
    assert changed["training.steps"] == 7 and "training.seq_len" in changed and "training.max_norm" not in changed
