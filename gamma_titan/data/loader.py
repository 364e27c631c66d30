"""The training dataloader TorchTitan's Trainer gets (TrainSpec.build_dataloader_fn).

`training.dataset = "builtin"` packs the built-in corpus into one token stream and cuts
DP-invariant samples from it (`PackedSequences`): the same global batches at any data
parallel degree. Every other dataset goes through TorchTitan's own streaming text
loader (`build_text_dataloader`), with the sources registered in `datasets.py`.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import build_text_dataloader

from gamma_titan.data.builtin_corpus import builtin_texts
from gamma_titan.data.packed import PackedSequences

PACKED_DATASETS = ("builtin",)


def builtin_tokens(tokenizer, split: str = "train") -> torch.Tensor:
    """The built-in corpus split as one stream: BOS, document, EOS, BOS, ..."""
    ids: list[int] = []
    for text in builtin_texts(split):
        ids.extend(tokenizer.encode(text, add_bos=True, add_eos=True))
    return torch.tensor(ids, dtype=torch.int32)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    training = job_config.training
    if training.dataset not in PACKED_DATASETS:
        return build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    dataset = PackedSequences(
        builtin_tokens(tokenizer, "train"),
        training.seq_len,
        dp_rank,
        dp_world_size,
        training.local_batch_size,
        infinite=infinite,
        name=training.dataset,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **{**asdict(training.dataloader), "batch_size": training.local_batch_size},
    )
