"""gamma_moe: fine-grained + shared experts, MHA or MLA, with γ-init, ε and the gate."""

from .args import MoEModelArgs, moe_flavors
from .model import GammaMoE, MoEBlock

__all__ = ["GammaMoE", "MoEBlock", "MoEModelArgs", "moe_flavors"]
