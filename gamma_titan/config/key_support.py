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
