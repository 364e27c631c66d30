"""model.json: which model a run's checkpoints hold, written next to them by the trainer.

A DCP checkpoint holds tensors only; converting one needs the architecture too (heads,
ε, the gate, RoPE θ cannot all be read off tensor shapes). The trainer writes
`<dump_folder>/<checkpoint.folder>/model.json` after every checkpoint save (not at start-up:
TorchTitan ignores `checkpoint.initial_load_path` once that folder exists): the TrainSpec name, the flavor,
every field of the model args after [model_args] and [gamma] were applied, and the
tokenizer folder. `convert` finds it next to a `step-N` folder (or inside it).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from gamma_titan.data.cache import write_json_atomic
from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import damaged, read_json
from gamma_titan.files import MODEL_FILE

#: What to do about a damaged model.json.
MODEL_RECORD_HINT = ("the checkpoint folder's record of its model: copy it from the run that wrote the checkpoint "
                     "(checkpoint/model.json)")

FORMAT = "gamma-titan-model"


def _public_fields(obj) -> dict[str, Any]:
    """A dataclass's fields, nested ones as dicts, without the private ones (TorchTitan's
    `_debug_force_load_balance`: a training switch, not the model a converter rebuilds)."""
    return {f.name: _public_fields(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
            for f in dataclasses.fields(obj) if not f.name.startswith("_")}


def model_record(model_name: str, flavor: str, args, tokenizer_dir: str | Path | None) -> dict[str, Any]:
    fields = _public_fields(args)
    return {"format": FORMAT, "version": 1, "model": model_name, "flavor": flavor, "args": fields,
            "tokenizer": str(tokenizer_dir) if tokenizer_dir else None}


def write_model_record(folder: str | Path, record: dict[str, Any]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / MODEL_FILE, record)
    return folder / MODEL_FILE


def find_model_record(checkpoint: Path) -> Path | None:
    for folder in (checkpoint, checkpoint.parent):
        if (folder / MODEL_FILE).is_file():
            return folder / MODEL_FILE
    return None


def args_from_record(record: dict[str, Any]):
    """(TrainSpec name, model args) rebuilt from a model.json record."""
    from gamma_titan.models import TRAIN_SPECS

    name = record.get("model")
    if record.get("format") != FORMAT or name not in TRAIN_SPECS:
        raise ConfigError(f"{MODEL_FILE}: not a gamma-titan model record (model {name!r}; "
                          f"allowed {', '.join(TRAIN_SPECS)})")
    flavors = TRAIN_SPECS[name].model_args
    args = flavors[record["flavor"]] if record["flavor"] in flavors else flavors[next(iter(flavors))]
    hints = typing.get_type_hints(type(args))
    for key, value in record["args"].items():
        if isinstance(value, dict):  # a nested dataclass (GammaInit, RoPE scaling), maybe optional
            kinds = [hints[key], *typing.get_args(hints[key])]
            value = next(k for k in kinds if dataclasses.is_dataclass(k))(**value)
        setattr(args, key, value)
    args.check()
    return name, args


def read_model_record(checkpoint: Path, key: str = "CHECKPOINT_DIR") -> tuple[str, Any, dict[str, Any]]:
    path = find_model_record(checkpoint)
    if path is None:
        raise ConfigError(f"{key}: no {MODEL_FILE} in {checkpoint} or {checkpoint.parent}; checkpoints "
                          "written by `gamma-titan train` have one next to them")
    record = read_json(path, MODEL_RECORD_HINT, keys=("format", "model", "flavor", "args"))
    try:
        name, args = args_from_record(record)
    except ConfigError as e:
        raise damaged(path, str(e).removeprefix(f"{MODEL_FILE}: "), MODEL_RECORD_HINT) from None
    except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as e:
        raise damaged(path, f"holds args this model cannot take ({type(e).__name__}: {e})", MODEL_RECORD_HINT) from None
    return name, args, record
