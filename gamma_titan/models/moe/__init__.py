"""gamma_moe: fine-grained + shared experts, MHA or MLA, with γ-init, ε and the gate."""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.protocols.train_spec import TrainSpec

from .args import MoEModelArgs, moe_flavors
from .model import GammaMoE, MoEBlock
from .parallelize import parallelize_moe
from .state_dict_adapter import MoEStateDictAdapter


def get_train_spec() -> TrainSpec:
    """The family as TorchTitan's TrainSpec (as gamma_dense's); its optimizer builder adds
    the expert-bias (aux-loss-free) update."""
    return TrainSpec(model_cls=GammaMoE, model_args=moe_flavors, parallelize_fn=parallelize_moe,
                     pipelining_fn=None, build_optimizers_fn=build_optimizers_with_moe_load_balancing,
                     build_lr_schedulers_fn=build_lr_schedulers, build_dataloader_fn=build_text_dataloader,
                     build_tokenizer_fn=build_hf_tokenizer, build_loss_fn=build_cross_entropy_loss,
                     state_dict_adapter=MoEStateDictAdapter)


__all__ = ["GammaMoE", "MoEBlock", "MoEModelArgs", "get_train_spec", "moe_flavors"]
