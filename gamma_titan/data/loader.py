"""The dataloaders TorchTitan's Trainer and Validator get.

Shard datasets ("builtin", "builtin_validation", "memmap"; shard_sources.py) are read as
`PackedSequences` (rank_batches.py) over their global sample sequence: DP-invariant,
checkpointed as one position that any data-parallel degree resumes, no tokenization in the
training process. Every other name ("hf", TorchTitan's own) goes
through TorchTitan's streaming text loader with the sources registered in registry.py.

`build_validation_dataloader` is the validator's (gamma_titan/training/validator.py).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import build_text_dataloader, build_text_validation_dataloader

from gamma_titan.data.names import is_shard_dataset
from gamma_titan.data.rank_batches import PackedSequences
from gamma_titan.data.shard_sources import open_samples
from gamma_titan.data.validation_set import ValidationBatches, ValidationSet
from gamma_titan.errors import ConfigError


def _check_workers(section, key: str) -> None:
    if section.dataloader.num_workers:
        raise ConfigError(f"{key}.dataloader.num_workers = {section.dataloader.num_workers}: must be 0 for "
                          f"dataset '{section.dataset}' (reads are memory-mapped; workers would only copy them)")


class ShardDataloader(ParallelAwareDataloader):
    """TorchTitan's dataloader around a `PackedSequences`, whose checkpoint state is where
    the global order stands: {"position": samples the ranks have read together}, the same
    number on every rank, so that any data-parallel degree, and any global batch, resumes
    at exactly the next sample. (TorchTitan's own state is one entry per data-parallel
    rank, and it refuses another degree; `legacy_form` reads checkpoints written so.)"""

    def __init__(self, dataset: PackedSequences, **kwargs):
        super().__init__(dataset, **kwargs)
        self.legacy_form = False

    def position(self) -> int:
        return self.dataset.position()

    def state_dict(self) -> dict[str, Any]:
        if self.legacy_form:
            return super().state_dict()
        return {"position": self.dataset.position()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "position" in state_dict:
            self.dataset.seek(int(state_dict["position"]))
        else:
            super().load_state_dict(state_dict)

    def read_form(self, keys: set[str]) -> None:
        """Present the form of the checkpoint about to be loaded (its DCP keys): TorchTitan's
        per-rank one when it holds no position (GammaCheckpointManager.load)."""
        self.legacy_form = "dataloader.position" not in keys and any(k.startswith("dataloader.") for k in keys)


def shard_dataloader(dataset: PackedSequences, dp_rank: int, dp_world_size: int, dataloader_config):
    """`ShardDataloader` around a `PackedSequences`, which yields whole batches itself
    (batch_size=None: no per-sample collation)."""
    return ShardDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                           **{**asdict(dataloader_config), "batch_size": None})


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    training = job_config.training
    if not is_shard_dataset(training.dataset):
        return build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    _check_workers(training, "training")
    samples = open_samples(job_config, "training", training.seq_len)
    on_exhausted = job_config.gamma.data.on_exhausted if infinite else "stop"
    dataset = PackedSequences(samples, dp_rank, dp_world_size, training.local_batch_size,
                              on_exhausted=on_exhausted, name=f"training.dataset '{training.dataset}'")
    return shard_dataloader(dataset, dp_rank, dp_world_size, training.dataloader)


def validation_set(job_config) -> ValidationSet:
    """The run's validation set (validation_set.py): validation.steps x local_batch_size
    sequences in all, whatever the layout (-1: the whole split)."""
    v = job_config.validation
    samples = open_samples(job_config, "validation", v.seq_len)
    return ValidationSet(samples, None if v.steps == -1 else v.steps * v.local_batch_size)


def build_validation_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = False):
    """Same signature as TorchTitan's `build_text_validation_dataloader`. A shard dataset gives
    the run's validation set, this rank's share of it, from its start on every pass (so
    val_loss is measured on the same data each time, at any layout); `infinite` is
    TorchTitan's, for its own text loader."""
    v = job_config.validation
    if not is_shard_dataset(v.dataset):
        return build_text_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    _check_workers(v, "validation")
    batches = ValidationBatches(validation_set(job_config), dp_rank, dp_world_size, v.local_batch_size)
    return ParallelAwareDataloader(batches, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   **{**asdict(v.dataloader), "batch_size": None})


def probe_tokens(job_config, n: int, tokenizer):
    """The first `n` sequences (training seq_len) of the validation data, as (n, seq_len)
    token ids, read without a DataLoader (which would draw from the global RNG)."""
    import itertools

    import torch

    v, seq_len = job_config.validation, job_config.training.seq_len
    if is_shard_dataset(v.dataset):
        samples = open_samples(job_config, "validation", seq_len)
        rows = [torch.from_numpy(samples.get(g)[:-1].astype("int64"))
                for g in range(min(n, samples.epoch_samples))]
    else:
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

        dataset = HuggingFaceTextDataset(dataset_name=v.dataset, dataset_path=v.dataset_path,
                                         tokenizer=tokenizer, seq_len=seq_len,
                                         dp_rank=0, dp_world_size=1, infinite=False)
        rows = [sample["input"] for sample, _ in itertools.islice(dataset, n)]
    if len(rows) < n:
        raise ConfigError(f"gamma.diagnostics.probe_batch = {n}: validation.dataset {v.dataset!r} has only "
                          f"{len(rows)} sequences of training.seq_len = {seq_len}")
    return torch.stack(rows)
