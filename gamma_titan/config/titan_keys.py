"""Every key of TorchTitan's own JobConfig (torchtitan 0.2.x, `torchtitan/config/job_config.py`),
field by field, with the values it can mean: `check_titan_keys(config)` fails on the first
value outside them with one ConfigError line that names the key as the TOML spells it.

TorchTitan checks few of its keys, and late: a TOML value is not converted to the field's
type, a negative `comm.trace_buf_size` or an `optimizer.name` of "adam" reaches a traceback
once the process group is up, and `lr_scheduler.total_steps` below `training.steps` trains
with a negative learning rate. The table below is the whole JobConfig (a test compares its
keys with TorchTitan's fields, so a new TorchTitan field fails the suite until it has a
rule here). Checks that need more than one key are `check_titan_combinations` (this file,
config alone) and `gamma_titan/training/preflight.py` (the world size, the model, files).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from gamma_titan.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """What a key allows: `test(value)` is true for a meant value; `allowed` ends the error
    line ("must be an integer >= 1", "allowed a, b"); `bad` are values a test feeds it."""

    allowed: str
    test: Callable[[Any], bool]
    bad: tuple = ()


def is_int(v) -> bool:
    """An integer that is not a bool (TOML and tyro give bools where ints are asked)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def flag() -> Rule:
    return Rule("must be true or false", lambda v: isinstance(v, bool), bad=("true", 1))


def integer(low: int, *, also: tuple[int, ...] = (), meaning: str = "") -> Rule:
    """An integer >= low, or one of the sentinel values `also` (meaning: what they mean)."""
    text = f"must be an integer >= {low}" + (f", or {' or '.join(map(str, also))}" if also else "")
    return Rule(text + (f" ({meaning})" if meaning else ""),
                lambda v: is_int(v) and (v >= low or v in also),
                bad=(low - 1 if low - 1 not in also else low - 2, 2.5, "8"))


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False) -> Rule:
    """A finite number in the interval from low to high (open or closed at either end)."""
    if high is None:
        text = f"must be a number {'>' if low_open else '>='} {low:g}"
    else:
        text = f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def test(v) -> bool:
        if not is_number(v):
            return False
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    bad = [low if low_open else low - 1, float("nan"), "0.1"]
    if high is not None:
        bad.append(high if high_open else high + 1)
    return Rule(text, test, bad=tuple(bad))


def choice(*names: str | None) -> Rule:
    shown = ", ".join("unset" if n is None else n for n in names)
    return Rule(f"allowed {shown}", lambda v: v in names, bad=("nope",))


def text(*, empty: bool = False) -> Rule:
    """A string (a name, a folder, a prefix); empty only where empty means "none"."""
    return Rule("must be a string" if empty else "must be a non-empty string",
                lambda v: isinstance(v, str) and (empty or v != ""), bad=(3,) if empty else (3, ""))


def names() -> Rule:
    return Rule("must be a list of names", lambda v: isinstance(v, list) and all(isinstance(n, str) and n for n in v),
                bad=([1], [""], "output"))


def optional(rule: Rule) -> Rule:
    """`rule`, or unset (None)."""
    return Rule(rule.allowed + " (or unset)", lambda v: v is None or rule.test(v),
                bad=tuple(b for b in rule.bad if b is not None))


#: The rule of a `Literal` field: its own choices, read from the annotation (TorchTitan owns them).
OWN_CHOICES = "the choices of the field's Literal annotation"


class Lazy:
    """Choices that cost an import to list: asked only for a value other than TorchTitan's
    default (which is one of them)."""

    def __init__(self, choices: Callable[[], typing.Iterable[str]], *, casefold: bool = False) -> None:
        self.choices, self.casefold = choices, casefold


def _pipeline_schedules() -> list[str]:
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        get_schedule_class("")
    except ValueError as e:  # its message lists the names; there is no public list
        return [n.strip(" '[]") for n in str(e).split("valid options are", 1)[1].split(",")]
    return []


def _compile_backends() -> list[str]:
    import torch._dynamo

    return sorted(b for b in torch._dynamo.list_backends(exclude_tags=()) if "TESTING" not in b and "minifier" not in b)


def _model_converters() -> list[str]:
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    return list(_registry_model_converter_cls)


def _selective_ac_option(v) -> bool:
    return isinstance(v, str) and (v == "op" or (v.isdigit() and int(v) >= 1))


def _fqn_lists(v) -> bool:
    return isinstance(v, list) and all(isinstance(part, list) and part and all(isinstance(n, str) for n in part)
                                       for part in v)


def _names_or_csv(v) -> bool:
    return isinstance(v, str) or names().test(v)


#: gamma-titan's "derive it from the machine" for two degrees TorchTitan takes as given
#: (gamma_titan/training/derive.py); TorchTitan's own -1 is data_parallel_shard_degree's.
AUTO = -1

#: What a TorchTitan checkpoint holds, by top-level key (checkpoint.exclude_from_loading).
CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")

#: Every key of TorchTitan's JobConfig. A key that any value of its type may take (a
#: description, a prefix) says so with text(empty=True).
RULES: dict[str, Rule | str | Lazy] = {
    # [job]
    "job.config_file": optional(text()),  # opened by gamma_titan/config/parse.py
    "job.dump_folder": text(),
    "job.description": text(empty=True),
    "job.print_config": flag(),
    "job.save_config_file": optional(text()),
    "job.custom_config_module": text(empty=True),  # imported by parse.py: "not a module with a JobConfig"
    # [profiling]
    "profiling.enable_profiling": flag(),
    "profiling.save_traces_folder": text(),
    "profiling.profile_freq": integer(1),
    "profiling.profiler_active": integer(1),
    "profiling.profiler_warmup": integer(0),
    "profiling.enable_memory_snapshot": flag(),
    "profiling.save_memory_snapshot_folder": text(),
    # [metrics]
    "metrics.log_freq": integer(1),
    "metrics.enable_tensorboard": flag(),
    "metrics.disable_color_printing": flag(),
    "metrics.save_tb_folder": text(),
    "metrics.save_for_all_ranks": flag(),
    "metrics.enable_wandb": flag(),
    # [model]: name and flavor against the registry (gamma_titan/inspect_model.py, resolve_model)
    "model.name": text(),
    "model.flavor": text(),
    "model.hf_assets_path": text(),  # the tokenizer, found by gamma_titan/data/tokenizer.py
    "model.tokenizer_path": optional(text()),
    "model.converters": Lazy(_model_converters),
    "model.print_after_conversion": flag(),
    # [optimizer]: TorchTitan's build_optimizers knows these two
    "optimizer.name": choice("Adam", "AdamW"),
    "optimizer.lr": number(0, low_open=True),
    "optimizer.beta1": number(0, 1, high_open=True),
    "optimizer.beta2": number(0, 1, high_open=True),
    "optimizer.eps": number(0, low_open=True),
    "optimizer.weight_decay": number(0),
    "optimizer.implementation": OWN_CHOICES,
    "optimizer.early_step_in_backward": flag(),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": integer(0),
    "lr_scheduler.total_steps": optional(integer(1)),
    "lr_scheduler.decay_ratio": optional(number(0, 1)),
    "lr_scheduler.decay_type": OWN_CHOICES,
    "lr_scheduler.min_lr_factor": number(0, 1),
    # [training]
    "training.dataset": text(),  # checked against the registry by gamma_titan/data/registry.py
    "training.dataset_path": optional(text()),
    "training.local_batch_size": integer(1),
    "training.global_batch_size": integer(1, also=(-1,), meaning="-1: local_batch_size x data-parallel degree"),
    "training.seq_len": integer(1),
    "training.max_norm": number(0, low_open=True),
    "training.steps": integer(1),
    "training.enable_cpu_offload": flag(),
    "training.dtype": OWN_CHOICES,
    "training.mixed_precision_param": OWN_CHOICES,
    "training.mixed_precision_reduce": OWN_CHOICES,
    "training.gc_freq": integer(1),
    "training.gc_debug": flag(),
    "training.dataloader.num_workers": integer(0),
    "training.dataloader.persistent_workers": flag(),
    "training.dataloader.pin_memory": flag(),
    "training.dataloader.prefetch_factor": optional(integer(1)),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": integer(1, also=(AUTO,), meaning="-1: one replica per node"),
    "parallelism.data_parallel_shard_degree": integer(1, also=(-1,), meaning="-1: the ranks left over"),
    "parallelism.fsdp_reshard_after_forward": OWN_CHOICES,
    "parallelism.tensor_parallel_degree": integer(1),
    "parallelism.disable_loss_parallel": flag(),
    "parallelism.enable_async_tensor_parallel": flag(),
    "parallelism.pipeline_parallel_degree": integer(1),
    "parallelism.module_fqns_per_model_part": optional(Rule("must be a list of lists of module names",
                                                            _fqn_lists, bad=(["layers.0"], [[]]))),
    "parallelism.pipeline_parallel_first_stage_less_layers": integer(0),
    "parallelism.pipeline_parallel_last_stage_less_layers": integer(0),
    "parallelism.pipeline_parallel_layers_per_stage": optional(integer(1)),
    "parallelism.pipeline_parallel_schedule": Lazy(_pipeline_schedules, casefold=True),
    "parallelism.pipeline_parallel_schedule_csv": optional(text(empty=True)),  # a file: preflight
    "parallelism.pipeline_parallel_microbatch_size": integer(1),
    "parallelism.pipeline_parallel_expert_parallel_overlap": flag(),
    "parallelism.context_parallel_degree": integer(1),
    "parallelism.context_parallel_load_balancer": choice("headtail", "ptrr", None),
    "parallelism.context_parallel_rotate_method": OWN_CHOICES,
    "parallelism.expert_parallel_degree": integer(1, also=(AUTO,), meaning="-1: the largest that fits a node"),
    "parallelism.expert_tensor_parallel_degree": integer(1),
    "parallelism.expert_parallel_comm_backend": OWN_CHOICES,
    # [checkpoint]
    "checkpoint.enable": flag(),
    "checkpoint.enable_ft_dataloader_checkpoints": flag(),
    "checkpoint.folder": text(),
    "checkpoint.interval": integer(1),
    "checkpoint.initial_load_path": optional(text()),  # a folder: preflight.check_checkpoint
    "checkpoint.initial_load_model_only": flag(),
    "checkpoint.initial_load_in_hf": flag(),
    "checkpoint.initial_load_in_hf_quantized": flag(),
    "checkpoint.last_save_model_only": flag(),
    "checkpoint.last_save_in_hf": flag(),
    "checkpoint.export_dtype": OWN_CHOICES,
    "checkpoint.async_mode": OWN_CHOICES,
    "checkpoint.keep_latest_k": Rule("must be 0 (keep all) or an integer >= 2 (TorchTitan keeps a spare while "
                                     "the newest may still be being written)",
                                     lambda v: is_int(v) and (v == 0 or v >= 2), bad=(1, -1, 2.5)),
    "checkpoint.load_step": integer(0, also=(-1,), meaning="-1: the latest"),
    "checkpoint.exclude_from_loading": Rule(f"allowed a list of {', '.join(CHECKPOINT_STATES)}",
                                            lambda v: isinstance(v, list) and set(v) <= set(CHECKPOINT_STATES),
                                            bad=(["optimiser"], "optimizer")),
    "checkpoint.enable_first_step_checkpoint": flag(),
    "checkpoint.create_seed_checkpoint": flag(),
    "checkpoint.load_only": flag(),
    # [activation_checkpoint]
    "activation_checkpoint.mode": OWN_CHOICES,
    "activation_checkpoint.selective_ac_option": Rule("must be \"op\" or a layer interval \"1\", \"2\", ...",
                                                      _selective_ac_option, bad=("0", "ops", 2)),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": names(),
    "activation_checkpoint.early_stop": flag(),
    "activation_checkpoint.memory_budget": number(0, 1),
    "activation_checkpoint.visualize_memory_budget_pareto": flag(),
    "activation_checkpoint.preserve_rng_state": flag(),
    "activation_checkpoint.determinism_check": choice("default", "none"),  # torch.utils.checkpoint's
    "activation_checkpoint.debug": flag(),
    # [compile]
    "compile.enable": flag(),
    "compile.components": Rule("allowed a list of model, loss",
                               lambda v: isinstance(v, list) and set(v) <= {"model", "loss"},
                               bad=(["models"], "model")),
    "compile.backend": Lazy(_compile_backends),
    # [quantize]
    "quantize.linear.float8.enable_fsdp_float8_all_gather": flag(),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": flag(),
    "quantize.linear.float8.recipe_name": OWN_CHOICES,
    "quantize.linear.float8.filter_fqns": names(),
    "quantize.linear.float8.emulate": flag(),
    "quantize.grouped_mm.float8.fqns": Rule("must be a list of names or one comma-separated string",
                                            _names_or_csv, bad=(3, [1])),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": OWN_CHOICES,
    "quantize.linear.mx.recipe_name": text(),  # torchao's name; MX training needs an SM100 GPU (preflight)
    "quantize.linear.mx.filter_fqns": names(),
    "quantize.grouped_mm.mx.recipe_name": OWN_CHOICES,
    "quantize.grouped_mm.mx.fqns": Rule("must be a list of names or one comma-separated string",
                                        _names_or_csv, bad=(3, [1])),
    # [comm]
    "comm.init_timeout_seconds": integer(1),
    "comm.train_timeout_seconds": integer(1),
    "comm.trace_buf_size": integer(0, meaning="0: no flight recorder"),
    "comm.save_traces_folder": text(),
    "comm.save_traces_file_prefix": text(empty=True),
    "comm.mode": OWN_CHOICES,
    # [memory_estimation]
    "memory_estimation.enable": flag(),
    "memory_estimation.disable_fake_mode": flag(),
    # [fault_tolerance]
    "fault_tolerance.enable": flag(),
    "fault_tolerance.process_group": choice("gloo", "nccl"),
    "fault_tolerance.process_group_timeout_ms": integer(1),
    "fault_tolerance.replica_id": integer(0),
    "fault_tolerance.group_size": integer(0),
    "fault_tolerance.min_replica_size": integer(1),
    "fault_tolerance.semi_sync_method": choice("local_sgd", "diloco", None),
    # [experimental]
    "experimental.custom_import": text(empty=True),  # imported by preflight: a module that exists
    "experimental.custom_args_module": text(empty=True),  # refused by pre-flight (key_support.UNREAD)
    # [validation]
    "validation.enable": flag(),
    "validation.dataset": text(),
    "validation.dataset_path": optional(text()),
    "validation.local_batch_size": integer(1),
    "validation.seq_len": integer(1),
    "validation.freq": integer(1),
    "validation.steps": integer(1, also=(-1,), meaning="-1: the whole split"),
    "validation.dataloader.num_workers": integer(0),
    "validation.dataloader.persistent_workers": flag(),
    "validation.dataloader.pin_memory": flag(),
    "validation.dataloader.prefetch_factor": optional(integer(1)),
    # [debug]
    "debug.seed": optional(integer(0)),
    "debug.deterministic": flag(),
    "debug.deterministic_warn_only": flag(),
    "debug.moe_force_load_balance": flag(),
}


def titan_fields(cls=None, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every leaf key of TorchTitan's JobConfig: {"section.key": (annotation, default)}."""
    if cls is None:
        from torchtitan.config.job_config import JobConfig as cls
    out = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            out.update(titan_fields(kind, f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if callable(f.default_factory) else f.default
            out[f"{prefix}{f.name}"] = (kind, default)
    return out


def _literal_choices(kind) -> tuple:
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)
    return tuple(c for a in typing.get_args(kind) if typing.get_origin(a) is typing.Literal
                 for c in typing.get_args(a)) + ((None,) if type(None) in typing.get_args(kind) else ())


def resolve(key: str, kind, default) -> Rule | Lazy:
    """The key's rule, with a Literal's choices read from its annotation."""
    rule = RULES[key]
    if rule is OWN_CHOICES:
        return choice(*_literal_choices(kind))
    return rule


def _check_lazy(key: str, rule: Lazy, value, default) -> None:
    values = value if isinstance(value, list) else [value]
    defaults = default if isinstance(default, list) else [default]
    if not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{key} = {value!r}: must be {'a list of names' if isinstance(value, list) else 'a name'}")
    asked = [v for v in values if v not in defaults]
    if not asked:
        return
    choices = list(rule.choices())
    known = {c.casefold() for c in choices} if rule.casefold else set(choices)
    for v in asked:
        if (v.casefold() if rule.casefold else v) not in known:
            raise ConfigError(f"{key} = {value!r}: {v!r} is not one of {', '.join(sorted(choices))}")


def check_titan_keys(config) -> None:
    """Every TorchTitan key of a parsed config against RULES (one line naming the first bad key)."""
    for key, (kind, default) in titan_fields().items():
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        rule = resolve(key, kind, default)
        if isinstance(rule, Lazy):
            _check_lazy(key, rule, value, default)
        elif not rule.test(value):
            raise ConfigError(f"{key} = {value!r}: {rule.allowed}")
    check_titan_combinations(config)


def check_titan_combinations(config) -> None:
    """Keys of TorchTitan's that each hold a meant value but cannot work together (those that
    need no world size, model or file; preflight.py has those)."""
    t, lr, ac, p = config.training, config.lr_scheduler, config.activation_checkpoint, config.parallelism
    if lr.total_steps is not None and lr.total_steps < t.steps:
        # TorchTitan's schedule runs its decay on past total_steps: a linear or sqrt decay
        # turns the learning rate negative, a cosine one climbs back up.
        raise ConfigError(f"lr_scheduler.total_steps = {lr.total_steps} is below training.steps = {t.steps}: past "
                          "it the decay runs on (a linear or sqrt learning rate turns negative); use at least "
                          "training.steps, or leave it unset")
    for section in ("training", "validation"):
        loader = getattr(config, section).dataloader
        if loader.num_workers == 0:
            for key, value, off in (("persistent_workers", loader.persistent_workers, False),
                                    ("prefetch_factor", loader.prefetch_factor, None)):
                if value != off:
                    raise ConfigError(f"{section}.dataloader.{key} = {value!r} needs {section}.dataloader.num_workers "
                                      "> 0 (PyTorch's DataLoader refuses it without worker processes)")
    if ac.mode == "memory_budget" and not (config.compile.enable and "model" in config.compile.components):
        raise ConfigError("activation_checkpoint.mode = \"memory_budget\" needs compile.enable = true with \"model\" "
                          "in compile.components (the budget is the compiler's partitioner's)")
    f8 = config.quantize.linear.float8
    if f8.recipe_name is not None and f8.enable_fsdp_float8_all_gather:
        raise ConfigError(f"quantize.linear.float8.enable_fsdp_float8_all_gather = true does not work with recipe_name "
                          f"= {f8.recipe_name!r} (TorchTitan's rule: float8 all-gather is tensorwise); unset one")
    if f8.recipe_name is not None and f8.emulate:
        # TorchTitan 0.2 builds a recipe's torchao config by name, without emulate: the key
        # would be accepted and ignored (on a CPU, torch's reference float8 matmul ran instead,
        # ~30 s a step of the debug model). Emulated float8 is tensorwise, with no recipe.
        raise ConfigError(f"quantize.linear.float8.emulate = true does not apply with recipe_name = "
                          f"{f8.recipe_name!r} (TorchTitan builds the recipe's config without it); unset recipe_name "
                          "for emulated tensorwise float8, or set emulate = false")
    prof = config.profiling
    if prof.enable_profiling and prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        raise ConfigError(f"profiling.profile_freq = {prof.profile_freq} must be >= profiler_warmup + "
                          f"profiler_active = {prof.profiler_warmup + prof.profiler_active}")
    if p.expert_tensor_parallel_degree not in (1, p.tensor_parallel_degree):
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree = {p.expert_tensor_parallel_degree}: allowed 1 "
                          f"or tensor_parallel_degree ({p.tensor_parallel_degree})")
    if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size} "
                          f"must divide training.local_batch_size = {t.local_batch_size}")
    if config.optimizer.early_step_in_backward:
        # The step runs inside backward, before the loss and gradient norm are known, so the
        # non-finite step guard cannot skip it; TorchTitan refuses EP and PP once started.
        if config.gamma.reliability.on_nonfinite == "skip":
            raise ConfigError("optimizer.early_step_in_backward = true cannot skip a non-finite step (it is taken "
                              "inside backward); set gamma.reliability.on_nonfinite = \"stop\"")
        for key in ("expert_parallel_degree", "pipeline_parallel_degree"):
            if getattr(p, key) > 1:
                raise ConfigError(f"optimizer.early_step_in_backward = true: TorchTitan does not support it with "
                                  f"parallelism.{key} > 1")
