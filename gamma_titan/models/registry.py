"""The model families by `[model] name`, each registered by its own package
(`models/<family>/__init__.py`) here and with TorchTitan."""

from __future__ import annotations

from torchtitan.protocols import train_spec as titan_train_spec
from torchtitan.protocols.train_spec import TrainSpec

TRAIN_SPECS: dict[str, TrainSpec] = {}


def register_family(name: str, spec: TrainSpec) -> None:
    """Idempotent: a module imported twice (e.g. by a test) registers once."""
    TRAIN_SPECS.setdefault(name, spec)
    if name not in titan_train_spec._extra_train_specs:
        titan_train_spec.register_train_spec(name, spec)
