"""The TrainSpecs gamma_titan registers with TorchTitan (`[model] name = ...`)."""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers, build_optimizers_with_moe_load_balancing
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.protocols import train_spec as _train_spec_module
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from gamma_titan.data.loader import build_dataloader, build_validator
from gamma_titan.metrics import build_metrics_processor
from gamma_titan.models.dense import GammaDense, dense_flavors
from gamma_titan.models.dense.parallelize import parallelize_dense
from gamma_titan.models.moe import GammaMoE, moe_flavors
from gamma_titan.models.moe.parallelize import parallelize_moe


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """TorchTitan's HF tokenizer; `hf_assets_path = "builtin"` means the project's own."""
    from gamma_titan.data.tokenizer import resolve_tokenizer_path

    return HuggingFaceTokenizer(str(resolve_tokenizer_path(job_config.model.hf_assets_path)))


def _spec(model_cls, flavors, parallelize_fn, build_optimizers_fn) -> TrainSpec:
    """TorchTitan's components, with our data, tokenizer and metrics."""
    return TrainSpec(
        model_cls=model_cls,
        model_args=flavors,
        parallelize_fn=parallelize_fn,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_fn,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_validator_fn=build_validator,
        build_metrics_processor_fn=build_metrics_processor,
    )


TRAIN_SPECS = {
    "gamma_dense": _spec(GammaDense, dense_flavors, parallelize_dense, build_optimizers),
    # MoE: TorchTitan's optimizer builder adds the expert-bias (aux-loss-free) update.
    "gamma_moe": _spec(GammaMoE, moe_flavors, parallelize_moe, build_optimizers_with_moe_load_balancing),
}


def register() -> None:
    """Idempotent: register every TrainSpec above."""
    for name, spec in TRAIN_SPECS.items():
        if name not in _train_spec_module._extra_train_specs:
            register_train_spec(name, spec)
