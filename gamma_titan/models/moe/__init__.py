"""gamma_moe: fine-grained + shared experts, MHA or MLA, with γ-init, ε and the gate."""

from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing

from gamma_titan.models.registry import register_family
from gamma_titan.training.train_spec import family_spec

from .args import MoEModelArgs, moe_flavors
from .model import GammaMoE, MoEBlock
from .parallelize import parallelize_moe
from .state_dict_adapter import MoEStateDictAdapter

# TorchTitan's optimizer builder adds the expert-bias (aux-loss-free) update.
register_family("gamma_moe", family_spec(GammaMoE, moe_flavors, parallelize_moe,
                                         build_optimizers_fn=build_optimizers_with_moe_load_balancing,
                                         state_dict_adapter=MoEStateDictAdapter))

__all__ = ["GammaMoE", "MoEBlock", "MoEModelArgs", "moe_flavors"]
