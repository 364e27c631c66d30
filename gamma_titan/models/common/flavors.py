"""Named flavors of a model family (TorchTitan's `TrainSpec.model_args`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from torchtitan.protocols.model import BaseModelArgs


class Flavors(Mapping):
    """Named flavors; each lookup hands out a fresh copy, since TorchTitan's Trainer
    mutates the args it gets (update_from_config)."""

    def __init__(self, table: dict[str, BaseModelArgs]):
        self._table = table

    def __getitem__(self, name: str) -> BaseModelArgs:
        return copy.deepcopy(self._table[name])

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)
