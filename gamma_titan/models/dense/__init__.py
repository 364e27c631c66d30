"""gamma_dense: the dense decoder with γ-init, ε and gated attention."""

from .args import DenseModelArgs, dense_flavors
from .model import GammaDense, TransformerBlock

__all__ = ["DenseModelArgs", "GammaDense", "TransformerBlock", "dense_flavors"]
