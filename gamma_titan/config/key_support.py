"""Where each key of TorchTitan's JobConfig takes effect in a run of `gamma-titan train`, so
that no key is accepted and then ignored.

Most keys are read by TorchTitan's Trainer and its components (checkpointing, metrics, the
optimizer, the validator, ...) or by ours, for every model. The rest fall in two groups:

* FAMILY_KEYS: read by a model family's own code (its parallelize or pipelining function,
  its model). A family that never reads one says so (`GammaArgs.unsupported_keys`: the key
  and why), and pre-flight refuses a value other than TorchTitan's default for it.
* UNREAD: keys no code of this run reads, refused the same way for every model.

tests/test_key_support.py walks TorchTitan's fields against this: each key read by the
trainer is named in the trainer's sources, and each family key is named in the code each
family's run takes, or refused for that family. A new TorchTitan key fails it until it has
a place here.
"""

from __future__ import annotations

from gamma_titan.errors import ConfigError
from gamma_titan.models.common.args import CONTEXT_KEYS, EXPERT_KEYS, PIPELINE_KEYS

#: Read by a family's parallelize or pipelining function (or its model): each family reads
#: them, or refuses them (GammaArgs.unsupported_keys).
FAMILY_KEYS = (
    "parallelism.fsdp_reshard_after_forward", "parallelism.enable_async_tensor_parallel",
    "parallelism.disable_loss_parallel",
    *PIPELINE_KEYS, *CONTEXT_KEYS, *EXPERT_KEYS,
    "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "activation_checkpoint.early_stop",
    "activation_checkpoint.memory_budget", "activation_checkpoint.visualize_memory_budget_pareto",
    "activation_checkpoint.preserve_rng_state", "activation_checkpoint.determinism_check",
    "activation_checkpoint.debug", "compile.backend", "training.enable_cpu_offload",
    "training.mixed_precision_reduce",
)

#: Keys nothing in a run reads: {key: what to use instead}.
UNREAD = {
    "model.tokenizer_path": "TorchTitan deprecated it; the tokenizer is model.hf_assets_path's",
    "memory_estimation.enable": "TorchTitan's memory estimation is a script of its own, not the trainer; "
                                "`gamma-titan inspect` estimates a config's memory",
    "memory_estimation.disable_fake_mode": "TorchTitan's memory estimation is a script of its own, not the trainer",
    "parallelism.context_parallel_rotate_method": "TorchTitan 0.2's context parallelism does not read it",
    # TorchTitan copies it into job.custom_config_module after the parse, when the JobConfig is
    # already merged: the module it names would extend nothing.
    "experimental.custom_args_module": "TorchTitan deprecated it for job.custom_config_module, which is read",
    # torchft replica groups: only TorchTitan's experimental FTTrainer (torchtitan.experiments.ft)
    # reads them; our trainer is a Trainer. Accepted, a replica trained data-parallel rank 0 of 1
    # (the whole batch, not its replica's half) and its metrics went to a replica_<id> folder.
    **{f"fault_tolerance.{key}": "only TorchTitan's experimental FTTrainer (torchtitan.experiments.ft) reads it; "
                                 "gamma-titan's trainer is TorchTitan's Trainer. A failed node is a restart from "
                                 "the newest checkpoint (README: Reliability)"
       for key in ("enable", "process_group", "process_group_timeout_ms", "replica_id", "group_size",
                   "min_replica_size", "semi_sync_method")},
    "checkpoint.enable_ft_dataloader_checkpoints": "only TorchTitan's experimental FTTrainer reads it (torchft "
                                                   "replica groups: fault_tolerance)",
}


def check_key_support(config, args) -> None:
    """Refuse, in one line, a value other than TorchTitan's default for a key this run would
    not read: one no code reads (UNREAD), or one the model's family does not
    (`args.unsupported_keys()`)."""
    from gamma_titan.config.titan_keys import titan_fields

    fields = titan_fields()
    refused = {**UNREAD, **args.unsupported_keys()}
    for key, why in refused.items():
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        default = fields[key][1]
        if value != default:
            raise ConfigError(f"{key} = {value!r}: {config.model.name} does not read it ({why}); leave it at "
                              f"TorchTitan's default ({default!r})")


#: Keys set for the code that runs before the trainer, which reads them there: {key: who}.
READ_BEFORE_THE_TRAINER = {
    "job.config_file": "the config parser (gamma_titan/config/parse.py)",
    "job.custom_config_module": "the config parser: the JobConfig extension it merges",
}

#: Readers that copy every field (a record or log of the config): a read by them alone is
#: no key taking effect.
COPIERS = ("torchtitan.config.job_config:to_dict",)


def effective_readers(readers: list[str]) -> list[str]:
    """The readers of a key (`module:function`) that act on it, not only copy it."""
    return [r for r in readers if r not in COPIERS]


def _degree_above_one(degree: str):
    """A _WAITS_FOR entry: the key waits for `parallelism.<degree>` > 1."""
    return (lambda c: getattr(c.parallelism, degree) > 1, f"parallelism.{degree} > 1")


#: Keys that wait for another key to turn them on: {key or section prefix: (is it on?, what turns it on)}.
#: A section with an `enable` switch needs no entry (its keys wait for `enable = true`).
_WAITS_FOR = {
    **{f"{converter}.": (lambda c, converter=converter: converter in c.model.converters,
                         f"model.converters with {converter}")
       for converter in ("quantize.linear.float8", "quantize.linear.mx", "quantize.grouped_mm.float8",
                         "quantize.grouped_mm.mx")},
    "profiling.save_memory_snapshot_folder": (lambda c: c.profiling.enable_memory_snapshot,
                                              "profiling.enable_memory_snapshot = true"),
    "profiling.": (lambda c: c.profiling.enable_profiling, "profiling.enable_profiling = true"),
    "metrics.save_tb_folder": (lambda c: c.metrics.enable_tensorboard, "metrics.enable_tensorboard = true"),
    "activation_checkpoint.": (lambda c: c.activation_checkpoint.mode != "none", "activation_checkpoint.mode"),
    **{prefix: _degree_above_one(degree) for prefix, degree in (
        ("parallelism.pipeline_parallel_", "pipeline_parallel_degree"),
        ("parallelism.module_fqns_per_model_part", "pipeline_parallel_degree"),
        ("parallelism.context_parallel_", "context_parallel_degree"),
        ("parallelism.expert_parallel_comm_backend", "expert_parallel_degree"),
        ("parallelism.enable_async_tensor_parallel", "tensor_parallel_degree"),
        ("parallelism.disable_loss_parallel", "tensor_parallel_degree"))},
}


#: Read by FSDP's wrapping alone (and TorchTitan's, of expert-parallel experts).
FSDP_KEYS = ("training.mixed_precision_reduce", "parallelism.fsdp_reshard_after_forward")

#: Switches that turn other keys on (as `section.enable` does): they wait for nothing.
SWITCHES = ("activation_checkpoint.mode", "profiling.enable_profiling", "profiling.enable_memory_snapshot")


def waiting(config, key: str, layout=None) -> str | None:
    """What turns the key on, where it is off in this config (nothing needs to read it
    then): `section.enable = true` for a key of a section switched off, or _WAITS_FOR's
    entry; None where the key is on. With the run's resolved `layout` (training/layout.py),
    FSDP's keys wait for a shard or expert degree above 1 (`data_parallel_shard_degree =
    -1` may resolve to 1)."""
    if key in SWITCHES or key.endswith(".enable"):
        return None
    if layout is not None and key in FSDP_KEYS and layout.shard == 1 and layout.ep == 1:
        return "FSDP: parallelism.data_parallel_shard_degree > 1"
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        section = config
        for part in parts[:depth]:
            section = getattr(section, part)
        if getattr(section, "enable", True) is False:
            return f"{'.'.join(parts[:depth])}.enable = true"
    for prefix, (on, what) in _WAITS_FOR.items():
        if key.startswith(prefix):
            return None if on(config) else what
    return None


def changed_keys(config) -> dict[str, object]:
    """{key: value} of every leaf key of a parsed config (TorchTitan's and the extension's)
    whose value is not its field's default."""
    from gamma_titan.config.titan_keys import titan_fields

    out = {}
    for key, (_, default) in titan_fields(type(config)).items():
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        if value != default:
            out[key] = value
    return out
