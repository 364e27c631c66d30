"""Model families. Each lives in one folder (args, model, parallelize, state-dict adapter)
and registers its TrainSpec when imported; a new family is a folder and a name below.
Shared layers live in `common/`."""

from gamma_titan.models import dense, moe, titan  # noqa: F401  (registers gamma_dense, gamma_moe, llama3)
from gamma_titan.models.registry import TRAIN_SPECS

__all__ = ["TRAIN_SPECS"]
