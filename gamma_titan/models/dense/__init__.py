"""gamma_dense: the dense decoder with γ-init, ε and gated attention."""

from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models.common.parallelize import parallelize_decoder
from gamma_titan.models.common.train_spec import family_train_spec

from .args import DenseModelArgs, dense_flavors
from .model import GammaDense, TransformerBlock
from .state_dict_adapter import DenseStateDictAdapter


def get_train_spec() -> TrainSpec:
    """The family as TorchTitan's TrainSpec, with TorchTitan's own components for the rest."""
    return family_train_spec(GammaDense, dense_flavors, parallelize_decoder, DenseStateDictAdapter)


__all__ = ["DenseModelArgs", "GammaDense", "TransformerBlock", "dense_flavors", "get_train_spec"]
