"""A Hugging Face folder as gamma-titan writes it, besides the weights, and which model
family reads one back.

The weights' names and the architecture part of config.json come from the family's
state-dict adapter (`TrainSpec.state_dict_adapter`, see models/common/hf_layout.py). Added
here, the same for every family: the TrainSpec name (so `from-hf` finds the family), the
tokenizer's BOS / EOS ids and the dtype in config.json; the modeling code of
convert/hf_package/ when config.json's `auto_map` asks for it, with the family's own
block file if it has one (its adapter's `HF_CODE`); the tokenizer files. Both
`convert to-hf` and the trainer's `checkpoint.last_save_in_hf` write these.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from gamma_titan.errors import ConfigError
from gamma_titan.files import TOKENIZER_FILE

MODEL_NAME_KEY = "gamma_titan_model"  # config.json: the TrainSpec name
PACKAGE = Path(__file__).parent / "hf_package"
CODE_FILES = ("configuration_gamma.py", "modeling_gamma.py")
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


def _converting_families() -> dict[str, Any]:
    """TrainSpec name -> its state-dict adapter class, for the families that have one."""
    from gamma_titan.models import TRAIN_SPECS

    return {name: spec.state_dict_adapter for name, spec in TRAIN_SPECS.items() if spec.state_dict_adapter}


def family_adapter(model_name: str, key: str = "CHECKPOINT_DIR"):
    """The state-dict adapter class of the TrainSpec `model_name`; a one-line error if none."""
    adapter = _converting_families().get(model_name)
    if adapter is None:
        raise ConfigError(f"{key}: {model_name} has no Hugging Face conversion")
    return adapter


def family_of_config(cfg: dict[str, Any]) -> tuple[str, Any]:
    """(TrainSpec name, adapter class) for a config.json: the family it names, else the one
    family that reads its model_type (a Llama from elsewhere names none)."""
    families, model_type = _converting_families(), cfg.get("model_type")
    name = cfg.get(MODEL_NAME_KEY)
    if name is not None and name not in families:
        raise ConfigError(f"config.json: {MODEL_NAME_KEY} = {name!r}: allowed {', '.join(families)}")
    pool = families if name is None else {name: families[name]}
    readers = {n: a for n, a in pool.items() if model_type in a.HF_MODEL_TYPES}
    if len(readers) == 1:
        return next(iter(readers.items()))
    if name is not None and not pool[name].HF_MODEL_TYPES:  # it converts from no folder: it says why
        return name, pool[name]  # (its args_from_hf_config)
    if readers:
        raise ConfigError(f"config.json: model_type {model_type!r} is read by {', '.join(readers)}; "
                          f"name one in {MODEL_NAME_KEY}")
    allowed = sorted({t for a in pool.values() for t in a.HF_MODEL_TYPES})
    raise ConfigError(f"config.json: model_type {model_type!r} cannot be converted"
                      f"{f' to {name}' if name else ''}; allowed: {', '.join(allowed)}")


def special_ids(tokenizer_dir: Path | None) -> tuple[int | None, int | None]:
    from gamma_titan.data.shards import tokenizer_info

    if tokenizer_dir is None:
        return None, None
    try:
        info = tokenizer_info(tokenizer_dir)
    except ConfigError:
        return None, None
    return info.bos_id, info.eos_id


def write_hf_files(out: str | Path, model_name: str, adapter, tokenizer_dir: str | Path | None,
                   dtype: torch.dtype) -> None:
    """config.json, the modeling code it needs, and the tokenizer files, into the existing
    folder `out` (next to weights written by `adapter.to_hf`)."""
    out = Path(out)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else None
    bos, eos = special_ids(tokenizer_dir)
    config = {**adapter.hf_config(), MODEL_NAME_KEY: model_name, "bos_token_id": bos, "eos_token_id": eos,
              "dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if "auto_map" in config:  # transformers loads the architecture from files in the folder
        # a family's own block file (HFStateDictAdapter.HF_CODE); TorchTitan's families' adapters have none
        for path in [*(PACKAGE / file for file in CODE_FILES), *getattr(adapter, "HF_CODE", ())]:
            shutil.copy(path, out / path.name)
    for file in TOKENIZER_FILES if tokenizer_dir else ():
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out / file)
