"""Model families. Each lives in one folder (args, model, state-dict adapter; a
parallelize function where `models/common/parallelize.parallelize_decoder` is not enough)
and exports its TorchTitan TrainSpec (`get_train_spec`); a new family is a folder and a
line below, or, kept in a package of its own, an entry point in the group
`gamma_titan.families` named as the TrainSpec:

    [project.entry-points."gamma_titan.families"]
    my_family = "my_package.my_family:get_train_spec"

gamma_titan/training/train_spec.py registers them all, with the project's components.
Shared layers live in `common/`."""

from importlib.metadata import entry_points

from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.models import dense, moe
from gamma_titan.models.titan import deepseek_v3, llama3, qwen3

#: The entry-point group of families installed from other packages.
FAMILY_ENTRY_POINTS = "gamma_titan.families"

#: Each family's TrainSpec by `[model] name`, as the family defines it.
TRAIN_SPECS: dict[str, TrainSpec] = {
    "gamma_dense": dense.get_train_spec(),
    "gamma_moe": moe.get_train_spec(),
    "llama3": llama3.get_train_spec(),
    "qwen3": qwen3.get_train_spec(),
    "deepseek_v3": deepseek_v3.get_train_spec(),
}


def _add_installed_families() -> None:
    for entry in entry_points(group=FAMILY_ENTRY_POINTS):
        if entry.name in TRAIN_SPECS:
            raise ValueError(f"entry point {entry.value} ({FAMILY_ENTRY_POINTS}) registers {entry.name!r}, "
                             "which is already a model family")
        TRAIN_SPECS[entry.name] = entry.load()()


_add_installed_families()

__all__ = ["FAMILY_ENTRY_POINTS", "TRAIN_SPECS"]
