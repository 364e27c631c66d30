"""Model families. Each lives in one folder (args, model, parallelize, state-dict adapter)
and exports its TorchTitan TrainSpec (`get_train_spec`); a new family is a folder and a line
below. gamma_titan/training/train_spec.py registers them, with the project's components.
Shared layers live in `common/`."""

from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models import dense, moe
from gamma_titan.models.titan import deepseek_v3, llama3, qwen3

#: Each family's TrainSpec by `[model] name`, as the family defines it.
TRAIN_SPECS: dict[str, TrainSpec] = {
    "gamma_dense": dense.get_train_spec(),
    "gamma_moe": moe.get_train_spec(),
    "llama3": llama3.get_train_spec(),
    "qwen3": qwen3.get_train_spec(),
    "deepseek_v3": deepseek_v3.get_train_spec(),
}

__all__ = ["TRAIN_SPECS"]
