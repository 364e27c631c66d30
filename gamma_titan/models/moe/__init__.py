"""gamma_moe: fine-grained + shared experts, MHA or MLA, with γ-init, ε and the gate."""

from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models.common.train_spec import family_train_spec

from .args import MoEModelArgs, moe_flavors
from .model import GammaMoE, MoEBlock
from .parallelize import parallelize_moe
from .state_dict_adapter import MoEStateDictAdapter


def get_train_spec() -> TrainSpec:
    """The family as TorchTitan's TrainSpec (as gamma_dense's); its optimizer builder adds
    the expert-bias (aux-loss-free) update."""
    return family_train_spec(GammaMoE, moe_flavors, parallelize_moe, MoEStateDictAdapter,
                             build_optimizers_fn=build_optimizers_with_moe_load_balancing)


__all__ = ["GammaMoE", "MoEBlock", "MoEModelArgs", "get_train_spec", "moe_flavors"]
