"""`gamma-titan convert to-hf` and `from-hf`: DCP checkpoints <-> Hugging Face folders.

to-hf reads a checkpoint's model tensors (whatever rank layout saved them) and its
model.json, and writes what the model family's state-dict adapter (its TrainSpec's
`state_dict_adapter`) makes of them: safetensors shards with their index, config.json,
the modeling code where the architecture needs it, and the tokenizer files
(hf_folder.py). from-hf reads such a folder back, through the family that config.json
names (or the one that reads its model_type), into a model-only DCP checkpoint plus
model.json, for `checkpoint.initial_load_path`. Each family maps exactly or refuses with
a one-line error; nothing is approximated.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from gamma_titan.convert.dcp_io import is_checkpoint, load_model_state, save_model_state
from gamma_titan.convert.hf_folder import TOKENIZER_FILES, family_adapter, family_of_config, write_hf_files
from gamma_titan.convert.model_record import model_record, read_model_record, write_model_record
from gamma_titan.data.cache import atomic_dir
from gamma_titan.data.tokenizer import TOKENIZER_HINT
from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import load_tokenizer, read_json
from gamma_titan.files import HF_INDEX_FILE, TOKENIZER_FILE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHARD_BYTES = 5 * 2**30  # per safetensors file, as transformers' save_pretrained does


#: What to do about a damaged file of a Hugging Face folder.
HF_FOLDER_HINT = "the Hugging Face folder's own file: download or convert the folder again"


def _check_out(out: Path, overwrite: bool, key: str) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"{key}: {out} exists and is not empty; choose a new folder or pass --overwrite")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_safetensors(state: dict[str, torch.Tensor], out: Path, progress: bool) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes

    def save(shard: dict[str, torch.Tensor], path: Path) -> None:
        save_file(shard, str(path), metadata={"format": "pt"})
        path.chmod(0o666 & ~_umask())  # safetensors writes 0600; every other file of the folder follows the umask

    if len(shards) == 1:
        save(shards[0], out / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="writing safetensors", disable=not progress), start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save(shard, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / HF_INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=1) + "\n")


def to_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", overwrite: bool = False,
          tokenizer: str | Path | None = None, progress: bool = True) -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: allowed {', '.join(DTYPES)}")
    if not is_checkpoint(checkpoint):
        raise ConfigError(f"CHECKPOINT_DIR: {checkpoint} is not a DCP checkpoint folder (no .metadata); "
                          "point at a checkpoint/step-N folder")
    name, args, record = read_model_record(checkpoint)
    adapter = family_adapter(name)(args, None)
    architecture = adapter.hf_config()["architectures"][0]  # a model with no HF form is refused here, before any I/O
    if progress and getattr(adapter, "package_reason", None):
        print(f"{name} -> {architecture} (load with trust_remote_code=True): {adapter.package_reason}",
              file=sys.stderr)
    tokenizer_dir = Path(tokenizer or record.get("tokenizer") or "")
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        raise ConfigError(f"--tokenizer: {tokenizer_dir} has no tokenizer.json (model.json names the run's "
                          "tokenizer; pass --tokenizer DIR if it moved)")
    load_tokenizer(tokenizer_dir / TOKENIZER_FILE, TOKENIZER_HINT)  # copied into the folder: a whole one
    _check_out(out, overwrite, "OUT_DIR")

    state = load_model_state(checkpoint, progress=progress)
    expected = _expected_shapes(name, args)
    if {k: tuple(v.shape) for k, v in state.items()} != expected:
        raise ConfigError(f"CHECKPOINT_DIR: {checkpoint} does not hold the {name} of its model.json "
                          "(tensor names or shapes differ)")
    hf_state = {k: v.to(DTYPES[dtype]) for k, v in adapter.to_hf(state).items()}
    with written_whole(out, overwrite) as folder:
        _write_safetensors(hf_state, folder, progress)
        write_hf_files(folder, name, adapter, tokenizer_dir, DTYPES[dtype])
    return out


@contextlib.contextmanager
def written_whole(out: Path, overwrite: bool):
    """A folder to write `out` in, renamed into place once complete: an interrupted or failed
    conversion leaves no partial folder to block its retry, and with `overwrite` the old
    folder stays until the new one is whole."""
    with atomic_dir(out, replace=overwrite) as folder:
        folder.chmod(0o777 & ~_umask())
        yield folder


def _expected_shapes(name: str, args) -> dict[str, tuple[int, ...]]:
    from gamma_titan.models import TRAIN_SPECS

    with torch.device("meta"):
        model = TRAIN_SPECS[name].model_cls(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _read_hf_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (folder / HF_INDEX_FILE).is_file():
        files = sorted(set(read_json(folder / HF_INDEX_FILE, HF_FOLDER_HINT, keys=("weight_map",))["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise ConfigError(f"HF_DIR: {folder} has no .safetensors weights")
    state = {}
    for file in files:
        state.update(load_file(str(folder / file)))
    return state


def from_hf(hf_dir: str | Path, checkpoint: str | Path, *, overwrite: bool = False) -> Path:
    hf_dir, checkpoint = Path(hf_dir), Path(checkpoint)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"HF_DIR: {hf_dir} has no config.json")
    cfg = read_json(config_file, HF_FOLDER_HINT)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{config_file}: holds no JSON object; {HF_FOLDER_HINT}")
    name, adapter_cls = family_of_config(cfg)
    args = adapter_cls.args_from_hf_config(cfg)
    _check_out(checkpoint, overwrite, "CHECKPOINT_DIR")
    state = adapter_cls(args, None).from_hf(_read_hf_state(hf_dir))
    expected = _expected_shapes(name, args)
    if {k: tuple(v.shape) for k, v in state.items()} != expected:
        raise ConfigError(f"HF_DIR: the weights in {hf_dir} do not match its config.json")
    with written_whole(checkpoint, overwrite) as folder:
        tokenizer_dir = None
        if (hf_dir / TOKENIZER_FILE).is_file():
            (folder / "tokenizer").mkdir()
            for file in TOKENIZER_FILES:
                if (hf_dir / file).is_file():
                    shutil.copy(hf_dir / file, folder / "tokenizer" / file)
            tokenizer_dir = checkpoint / "tokenizer"  # where it will be: the record names it
        save_model_state(state, folder)
        write_model_record(folder, model_record(name, "from-hf", args, tokenizer_dir))
    return checkpoint
