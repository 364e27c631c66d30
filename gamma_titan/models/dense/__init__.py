"""gamma_dense: the dense decoder with γ-init, ε and gated attention."""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.protocols.train_spec import TrainSpec

from .args import DenseModelArgs, dense_flavors
from .model import GammaDense, TransformerBlock
from .parallelize import parallelize_dense
from .state_dict_adapter import DenseStateDictAdapter


def get_train_spec() -> TrainSpec:
    """The family as TorchTitan's TrainSpec, with TorchTitan's own components for the rest
    (gamma_titan/training/train_spec.py puts the project's data, tokenizer, metrics and
    validator in when it registers the family)."""
    return TrainSpec(model_cls=GammaDense, model_args=dense_flavors, parallelize_fn=parallelize_dense,
                     pipelining_fn=None, build_optimizers_fn=build_optimizers,
                     build_lr_schedulers_fn=build_lr_schedulers, build_dataloader_fn=build_text_dataloader,
                     build_tokenizer_fn=build_hf_tokenizer, build_loss_fn=build_cross_entropy_loss,
                     state_dict_adapter=DenseStateDictAdapter)


__all__ = ["DenseModelArgs", "GammaDense", "TransformerBlock", "dense_flavors", "get_train_spec"]
