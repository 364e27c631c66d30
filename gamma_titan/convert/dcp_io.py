"""Model tensors in and out of DCP checkpoints, in one process with no process group.

A TorchTitan checkpoint folder (`checkpoint/step-N`) holds the model's tensors under their
plain names ("layers.0.attention.wq.weight") next to "optimizer.", "lr_scheduler.",
"dataloader." and "train_state." entries. DCP stores each tensor whole in its metadata, however
it was sharded when saved, so reading at FSDP=1 gives the same tensors as the save layout.
A model-only checkpoint written here is what TorchTitan's `checkpoint.initial_load_path`
loads (with `initial_load_model_only = true`, its default).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from gamma_titan.errors import ConfigError

NOT_MODEL = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.", "diagnostics.")  # checkpoint.DIAGNOSTICS_STATE


def is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


#: torch's UserWarning on every DCP load without a process group, which is what we mean.
SINGLE_PROCESS_LOAD = ".*assuming the intent is to load in a single process"


def load_model_state(checkpoint: str | Path, min_ndim: int = 0, key: str = "CHECKPOINT_DIR",
                     progress: bool = False) -> dict[str, torch.Tensor]:
    """Every model tensor (with at least `min_ndim` dimensions) of a DCP checkpoint, on CPU.
    With `progress`, read one layer at a time under a progress bar."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from tqdm import tqdm

    checkpoint = Path(checkpoint)
    if not is_checkpoint(checkpoint):
        raise ConfigError(f"{key}: {checkpoint} is not a DCP checkpoint folder (no .metadata); "
                          "point at a checkpoint/step-N folder")
    reader = dcp.FileSystemReader(str(checkpoint))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, meta in reader.read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and len(meta.size) >= min_ndim and not name.startswith(NOT_MODEL):
            group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else ""
            groups.setdefault(group, {})[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if not groups:
        raise ConfigError(f"{key}: {checkpoint} holds no model weights")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_LOAD)
        chunks = groups.values() if progress else [{k: v for g in groups.values() for k, v in g.items()}]
        for chunk in tqdm(chunks, desc=f"reading {checkpoint.name}", unit="layer", disable=not progress):
            dcp.load(chunk, storage_reader=dcp.FileSystemReader(str(checkpoint)), no_dist=True)
    return {k: v for g in groups.values() for k, v in g.items()}


def save_model_state(state: dict[str, torch.Tensor], checkpoint: str | Path) -> None:
    """Write `state` as a model-only DCP checkpoint into the (new or empty) folder `checkpoint`."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(checkpoint)), no_dist=True)
