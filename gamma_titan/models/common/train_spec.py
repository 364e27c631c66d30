"""A family of ours as TorchTitan's TrainSpec: its model, flavors, parallelize function and
state-dict adapter, with TorchTitan's own components for the rest (its pipelining function:
the stages split the decoder by module name, as for its llama3).
gamma_titan/training/train_spec.py puts the project's data, tokenizer, metrics and
validator in when it registers the family."""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.protocols.train_spec import TrainSpec


def family_train_spec(model_cls, flavors, parallelize_fn, state_dict_adapter, *,
                      build_optimizers_fn=build_optimizers) -> TrainSpec:
    return TrainSpec(model_cls=model_cls, model_args=flavors, parallelize_fn=parallelize_fn, pipelining_fn=pipeline_llm,
                     build_optimizers_fn=build_optimizers_fn, build_lr_schedulers_fn=build_lr_schedulers,
                     build_dataloader_fn=build_text_dataloader, build_tokenizer_fn=build_hf_tokenizer,
                     build_loss_fn=build_cross_entropy_loss, state_dict_adapter=state_dict_adapter)
