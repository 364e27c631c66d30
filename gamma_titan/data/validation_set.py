"""A run's validation set: the first N sequences of the validation data's global order
(sampling.py), the same sequences at every layout and after every resume.

N is global: `validation.steps × validation.local_batch_size` sequences in all (TorchTitan
reads that many per data-parallel rank, so its set grew with the degree), or with
`validation.steps = -1` the whole split. Where the split holds fewer sequences, the set is
the whole split, once: no sequence is counted twice (`capped` says so).

A mixture's sequences are validated source by source, so that each source has a loss of
its own (`val_loss/<source>`): source s's sequences among the first N, in global batches of
W × B (W data-parallel ranks, local batch B), rank r taking the r-th slice of B. The last
batch of a source is padded with rows whose labels are all ignored, so every rank runs as
many batches (none waits for another in a collective) and padding adds no loss and no
token.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchtitan.components.loss import IGNORE_INDEX


def source_of(samples, g: int) -> tuple[int, int]:
    """(source, draw of that source) of global sample g: a Mixture's, or the one stream's."""
    return samples.locate(g) if hasattr(samples, "locate") else (0, g)


def streams_of(samples) -> list:
    return list(samples.sources) if hasattr(samples, "sources") else [samples]


class ValidationSet:
    """The first `sequences` samples of `samples` (None: every sample of the split's first
    epoch), grouped by source."""

    def __init__(self, samples, sequences: int | None):
        self.samples = samples
        available = self._first_epoch(samples)
        self.requested = sequences
        self.size = available if sequences is None else min(sequences, available)
        self.capped = sequences is not None and sequences > available
        self.source_names = samples.source_names  # a Mixture's sources, or the one stream
        self.draws: list[list[int]] = [[] for _ in self.source_names]
        for g in range(self.size):
            s, k = source_of(samples, g)
            self.draws[s].append(k)

    @staticmethod
    def _first_epoch(samples) -> int:
        """Samples before the first stream wraps (a Mixture's epoch_samples is approximate)."""
        n = samples.epoch_samples
        while n > 0 and samples.first_exhausted(n - 1) is not None:
            n -= 1
        return n

    def batches_per_rank(self, world: int, batch: int) -> int:
        return sum(math.ceil(len(d) / (world * batch)) for d in self.draws)

    def rank_batches(self, rank: int, world: int, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """(input, labels, source) of every local batch of `rank`, source by source."""
        streams = streams_of(self.samples)
        size = world * batch
        for s, draws in enumerate(self.draws):
            for start in range(0, len(draws), size):
                chunk = draws[start:start + size]
                mine = chunk[rank * batch:(rank + 1) * batch]
                rows = [streams[s].window(k) for k in mine]
                real = len(rows)
                rows += [streams[s].window(chunk[0])] * (batch - real)  # padding: a real row, its labels ignored
                window = torch.from_numpy(np.stack(rows).astype(np.int64))
                labels = window[:, 1:].clone()
                labels[real:] = IGNORE_INDEX
                yield window[:, :-1], labels, s

    def tokens(self, seq_len: int) -> int:
        return self.size * seq_len


class ValidationBatches(IterableDataset):
    """One data-parallel rank's batches of a `ValidationSet`, from its start on every pass,
    as the dataloader yields them: ({"input", "source"}, labels)."""

    def __init__(self, validation_set: ValidationSet, dp_rank: int, dp_world_size: int, local_batch_size: int):
        self.set, self.rank, self.world, self.batch = validation_set, dp_rank, dp_world_size, local_batch_size

    def __iter__(self):
        for inputs, labels, source in self.set.rank_batches(self.rank, self.world, self.batch):
            yield {"input": inputs, "source": torch.tensor(source)}, labels

    # The validation set is read from its start on every pass: nothing to checkpoint.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
