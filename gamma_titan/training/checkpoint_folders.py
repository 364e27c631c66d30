"""Which checkpoints a checkpoint folder holds, by what is on disk ([gamma.reliability]).

A step-N folder counts only once its DCP `.metadata` is written (DCP writes it last). A
complete one whose data files were damaged afterwards (a file missing, or shorter than the
bytes `.metadata` says it holds: `damage`) is passed over for the newest intact one
(`newest_intact`). At start-up, incomplete folders are reported; keep-last-K counts and deletes only complete
ones, so it never removes the only complete checkpoint (TorchTitan's own purge counts
every step-N folder). Used by the CheckpointManager subclass (checkpoint.py), pre-flight
and the tools, none of which needs a manager to ask; reading the steps imports no torch (the
SLURM job's own steps and `gamma-titan status` ask it).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from gamma_titan.files import STEP_FOLDER, step_folder


def checkpoint_steps(folder: str | os.PathLike) -> tuple[list[int], list[int]]:
    """(complete, incomplete) step numbers of the DCP step-N folders in a checkpoint
    folder. A finished Hugging Face export (`checkpoint.last_save_in_hf`: config.json and
    safetensors, no .metadata) is neither: it is never resumed from, nor purged."""
    complete, incomplete = [], []
    root = Path(folder)
    if not root.is_dir():
        return complete, incomplete
    for entry in root.iterdir():
        match = STEP_FOLDER.match(entry.name)
        if not match or not entry.is_dir() or is_hf_export(entry):
            continue
        (complete if (entry / ".metadata").is_file() else incomplete).append(int(match.group(1)))
    return sorted(complete), sorted(incomplete)


def damage(step_path: str | os.PathLike) -> str | None:
    """What is wrong with a complete checkpoint's files, or None: every file `.metadata`
    names must exist and hold the bytes it says (offset + length of its last item)."""
    from torch.distributed.checkpoint import FileSystemReader

    root = Path(step_path)
    try:
        storage = FileSystemReader(str(root)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001  (a truncated .metadata: unpickling fails in many ways)
        return f".metadata unreadable ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (storage or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < size:
            return f"{name} holds {path.stat().st_size:,} of its {size:,} bytes"
    return None


def newest_intact(folder: str | os.PathLike) -> tuple[int | None, list[tuple[int, str]]]:
    """(the newest complete step whose files are intact or None, [(newer damaged step, why)])."""
    complete, _ = checkpoint_steps(folder)
    damaged = []
    for step in reversed(complete):
        why = damage(Path(folder) / step_folder(step))
        if why is None:
            return step, damaged
        damaged.append((step, why))
    return None, damaged


def is_hf_export(folder: Path) -> bool:
    """config.json is written last, after TorchTitan's safetensors (GammaCheckpointManager)."""
    return (folder / "config.json").is_file() and not (folder / ".metadata").is_file()


def report_incomplete_checkpoints(folder: str | os.PathLike) -> list[int]:
    """Log the checkpoint folders a killed save left behind (they are never loaded)."""
    from torchtitan.tools.logging import logger

    complete, incomplete = checkpoint_steps(folder)
    if incomplete:
        logger.warning(
            f"incomplete checkpoint(s) in {folder} (a save was interrupted): "
            f"{', '.join(step_folder(s) for s in incomplete)}; ignored. Resuming from "
            + (step_folder(complete[-1]) if complete else "scratch (no complete checkpoint)")
        )
    return incomplete


def purge_keeping_complete(checkpointer) -> None:
    """Replacement for TorchTitan's CheckpointManager._purge_stale_checkpoints: keep the
    newest `keep_latest_k` complete checkpoints; delete older complete ones and the
    incomplete ones older than the newest complete (a newer incomplete one may be a save
    still in flight)."""
    import torch.distributed as dist

    if checkpointer.keep_latest_k <= 0 or dist.get_rank() != 0 or not os.path.isdir(checkpointer.folder):
        return
    complete, incomplete = checkpoint_steps(checkpointer.folder)
    doomed = complete[: -checkpointer.keep_latest_k]
    if complete:
        doomed += [s for s in incomplete if s < complete[-1]]
    for step in sorted(doomed):
        checkpointer.purge_queue.put(os.path.join(checkpointer.folder, step_folder(step)))


def saved_progress(step_path: str | os.PathLike) -> dict:
    """What a complete checkpoint says of where its run stood, read without a process group:
    {"keys": its DCP keys, "step", "tokens_seen", "global_batch_size",
    "data_parallel_degree", "position"} with None for what it does not hold. Checkpoints
    of TorchTitan's form (and of datasets read per rank) hold no position; their
    data-parallel degree is the number of per-rank dataloader entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from gamma_titan.convert.dcp_io import SINGLE_PROCESS_LOAD

    keys = set(FileSystemReader(str(step_path)).read_metadata().state_dict_metadata)
    wanted = {"train_state": {k: 0 for k in ("step", "tokens_seen", "global_batch_size", "data_parallel_degree")
                              if f"train_state.{k}" in keys},
              "dataloader": {"position": 0} if "dataloader.position" in keys else {}}
    wanted = {k: v for k, v in wanted.items() if v}
    if wanted:
        with warnings.catch_warnings():  # torch's 2-line warning before every pre-flight that resumes
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_LOAD)
            dcp.load(wanted, checkpoint_id=str(step_path), no_dist=True)
    train, loader = wanted.get("train_state", {}), wanted.get("dataloader", {})
    ranks = {k.split(".")[1] for k in keys if k.startswith("dataloader.dp_rank_")}
    return {"keys": keys, "step": train.get("step"), "tokens_seen": train.get("tokens_seen"),
            "global_batch_size": train.get("global_batch_size"),
            "data_parallel_degree": train.get("data_parallel_degree", len(ranks) or None),
            "position": loader.get("position")}
