"""Model families. Each lives in one folder (args, model, state-dict adapter; a
parallelize function where `models/common/parallelize.parallelize_decoder` is not enough)
and exports its TorchTitan TrainSpec (`get_train_spec`); a new family is a folder and a
line below, or, kept in a package of its own, an entry point in the group
`gamma_titan.families` named as the TrainSpec:

    [project.entry-points."gamma_titan.families"]
    my_family = "my_package.my_family:get_train_spec"

gamma_titan/training/train_spec.py registers them all, with the project's components; a new
folder's entry in the README's Layout is written by `python tools/readme_tables.py --write`.
Shared layers live in `common/`."""

from collections.abc import Mapping
from importlib.metadata import entry_points

from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models import dense, moe
from gamma_titan.models.titan import deepseek_v3, llama3, qwen3

#: The entry-point group of families installed from other packages.
FAMILY_ENTRY_POINTS = "gamma_titan.families"

class FamilyRegistry(Mapping):
    """Each family's TrainSpec by `[model] name`: the package's own, then the installed
    ones, whose entry points are loaded at the first lookup rather than at import: a family
    package imports gamma_titan.models itself, and would otherwise be loaded half-imported."""

    def __init__(self, own: dict[str, TrainSpec]):
        self._specs, self._installed = dict(own), False

    def _all(self) -> dict[str, TrainSpec]:
        if not self._installed:
            self._installed = True
            for entry in entry_points(group=FAMILY_ENTRY_POINTS):
                if entry.name in self._specs:
                    raise ValueError(f"entry point {entry.value} ({FAMILY_ENTRY_POINTS}) registers {entry.name!r}, "
                                     "which is already a model family")
                self._specs[entry.name] = entry.load()()
        return self._specs

    def __getitem__(self, name: str) -> TrainSpec:
        return self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


TRAIN_SPECS = FamilyRegistry({
    "gamma_dense": dense.get_train_spec(),
    "gamma_moe": moe.get_train_spec(),
    "llama3": llama3.get_train_spec(),
    "qwen3": qwen3.get_train_spec(),
    "deepseek_v3": deepseek_v3.get_train_spec(),
})

__all__ = ["FAMILY_ENTRY_POINTS", "TRAIN_SPECS"]
