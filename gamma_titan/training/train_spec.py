"""The TrainSpec of a model family: its model, flavors and parallelize function, with
TorchTitan's components and ours (data, tokenizer, metrics)."""

import dataclasses

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.data.loader import build_dataloader, build_validator
from gamma_titan.training.metrics import build_metrics_processor
from gamma_titan.training.optimizer import with_weight_decay_policy


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """TorchTitan's HF tokenizer; `hf_assets_path = "builtin"` means the project's own."""
    from gamma_titan.data.tokenizer import resolve_tokenizer_path

    return HuggingFaceTokenizer(str(resolve_tokenizer_path(job_config.model.hf_assets_path)))


def family_spec(model_cls, flavors, parallelize_fn, *, build_optimizers_fn=build_optimizers,
                state_dict_adapter=None) -> TrainSpec:
    return with_our_components(TrainSpec(
        model_cls=model_cls,
        model_args=flavors,
        parallelize_fn=parallelize_fn,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_fn,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=state_dict_adapter,
    ))


def with_our_components(spec: TrainSpec) -> TrainSpec:
    """A TrainSpec with the project's data (shard datasets, and TorchTitan's text loader for
    the others), tokenizer ("builtin") and metrics (metrics.jsonl, diagnostics) builders, and
    the family's optimizer builder followed by [optimizer] weight_decay_policy."""
    return dataclasses.replace(spec, build_dataloader_fn=build_dataloader, build_tokenizer_fn=build_tokenizer,
                               build_validator_fn=build_validator,
                               build_metrics_processor_fn=build_metrics_processor,
                               build_optimizers_fn=with_weight_decay_policy(spec.build_optimizers_fn))
