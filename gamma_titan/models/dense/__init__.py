"""gamma_dense: the dense decoder with γ-init, ε and gated attention."""

from gamma_titan.models.registry import register_family
from gamma_titan.training.train_spec import family_spec

from .args import DenseModelArgs, dense_flavors
from .model import GammaDense, TransformerBlock
from .parallelize import parallelize_dense
from .state_dict_adapter import DenseStateDictAdapter

register_family("gamma_dense", family_spec(GammaDense, dense_flavors, parallelize_dense,
                                           state_dict_adapter=DenseStateDictAdapter))

__all__ = ["DenseModelArgs", "GammaDense", "TransformerBlock", "dense_flavors"]
