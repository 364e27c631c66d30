"""The families' TrainSpecs as the trainer runs them: each family's own (gamma_titan/models),
with the project's data (shard datasets, and TorchTitan's text loader for the others),
tokenizer ("builtin"), metrics (metrics.jsonl, diagnostics), validator, the family's
optimizer builder followed by [optimizer] weight_decay_policy, and its parallelize function
with the gradient reductions made sums (DDP's, and FSDP's on a CPU); registered with TorchTitan
under the family's name, so TorchTitan's trainer and ours both build them; and
`resolve_model`, the registered spec and model args a config asks for.

Importing this module registers the families and the datasets with TorchTitan (so
TorchTitan's own trainer finds them through `--experimental.custom_import
gamma_titan.training.train_spec`, as every config of ours says)."""

import dataclasses
import functools

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.protocols import train_spec as titan_train_spec
from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.config.parse import titan_warnings_held
from gamma_titan.data.loader import build_dataloader
from gamma_titan.data.registry import register_datasets
from gamma_titan.errors import ConfigError
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.training.metrics import build_metrics_processor
from gamma_titan.training.optimizer import with_weight_decay_policy
from gamma_titan.training.validator import build_validator


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """TorchTitan's HF tokenizer; `hf_assets_path = "builtin"` means the project's own."""
    from gamma_titan.data.tokenizer import resolve_tokenizer_path

    return HuggingFaceTokenizer(str(resolve_tokenizer_path(job_config.model.hf_assets_path)))


def mask_tokenizer(job_config, args) -> HuggingFaceTokenizer | None:
    """The run's tokenizer where the model's attention masks need its EOS (flex), for the
    readers that build them as the trainer does (models/common/masks.py); None otherwise."""
    return build_tokenizer(job_config) if args.takes_attention_masks() else None


def with_summed_gradients(parallelize_fn):
    """The family's parallelize function, then the gradient reductions made sums, for our
    families and TorchTitan's alike (models/common/parallelize.py): where it applied DDP
    (replicas without shards), summed over the replicas rather than averaged; where it
    applied FSDP on a CPU, reduce-scattered with gloo's SUM (it has no PREMUL_SUM)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config):
        from torch.distributed._composable.replicate import replicate
        from torchtitan.tools.utils import device_type

        from gamma_titan.models.common.parallelize import force_sum_reductions, sum_ddp_gradients

        model = parallelize_fn(model, parallel_dims, job_config)
        if replicate.state(model) is not None:
            sum_ddp_gradients(model, parallel_dims.get_mesh("dp_replicate").get_group())
        if device_type == "cpu":
            force_sum_reductions(model)
        return model

    return parallelize


def with_our_components(spec: TrainSpec) -> TrainSpec:
    return dataclasses.replace(spec, parallelize_fn=with_summed_gradients(spec.parallelize_fn),
                               build_dataloader_fn=build_dataloader, build_tokenizer_fn=build_tokenizer,
                               build_validator_fn=build_validator,
                               build_metrics_processor_fn=build_metrics_processor,
                               build_optimizers_fn=with_weight_decay_policy(spec.build_optimizers_fn))


def register_families() -> None:
    """Register every family with TorchTitan, once (a second call, e.g. from a test that
    imports the package again, changes nothing)."""
    for name, spec in TRAIN_SPECS.items():
        if name not in titan_train_spec._extra_train_specs:
            titan_train_spec.register_train_spec(name, with_our_components(spec))


def resolve_model(job_config):
    """(TrainSpec, model args with [model_args] and [gamma] applied) for a config."""
    from torchtitan.protocols.train_spec import get_train_spec

    name, flavor = job_config.model.name, job_config.model.flavor
    try:
        spec = get_train_spec(name)
    except (ValueError, ImportError):
        from gamma_titan.models import TRAIN_SPECS

        raise ConfigError(f"model.name = {name!r}: allowed {', '.join(TRAIN_SPECS)}") from None
    if flavor not in spec.model_args:
        raise ConfigError(f"model.flavor = {flavor!r}: allowed for {name}: {', '.join(spec.model_args)}")
    args = spec.model_args[flavor]  # a fresh copy (Flavors)
    with titan_warnings_held():  # a check: the trainer resolves again and logs them
        args.update_from_config(job_config)
    return spec, args


register_families()
register_datasets()
