"""A data-parallel rank's share of a global sample sequence (sampling.py), as the
checkpointable dataset TorchTitan's dataloader iterates.

Global batch k is samples k·W·B ... (k+1)·W·B − 1; data-parallel rank r of W, with local
batch B, takes the r-th slice of B. So one process with batch W·B sees exactly the union of
what W processes with batch B see: runs at different FSDP degrees train on the same data,
which is what makes them comparable step by step. The state is the number of samples this
rank has taken, so a resumed run continues with the very next batch. Between steps the
ranks together have read the first `position()` samples of the global order whatever W
and B are: `seek(position)` starts a rank there, so a run resumes at another
data-parallel degree, or with another global batch, at exactly the next sample
(loader.ShardDataloader checkpoints that position).

It yields whole local batches (B, L) rather than samples: the dataloader then does no
per-sample collation (build it with batch_size=None, as `loader.shard_dataloader` does),
which is most of the cost of a memory-mapped read.

When the first epoch of a stream ends, training either wraps (`on_exhausted = "wrap"`, the
stream logs it) or stops before the first global batch that would need a wrapped sample
(`"stop"`; every rank stops at the same batch, so none waits for the others). Validation
reads a fixed set of its own (validation_set.py).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from gamma_titan.data.names import ON_EXHAUSTED
from gamma_titan.errors import ConfigError

logger = logging.getLogger(__name__)


class PackedSequences(IterableDataset, Stateful):
    """One data-parallel rank's local batches of a global sample sequence (see the module)."""

    def __init__(self, samples, dp_rank: int, dp_world_size: int, local_batch_size: int, *,
                 on_exhausted: str = "wrap", name: str = "dataset",
                 key: str = "training.dataset"):
        if on_exhausted not in ON_EXHAUSTED:
            raise ConfigError(f"gamma.data.on_exhausted = {on_exhausted!r}: allowed {', '.join(ON_EXHAUSTED)}")
        self.samples = samples
        self.rank, self.world, self.batch = dp_rank, dp_world_size, local_batch_size
        self.stop = on_exhausted == "stop"
        self.name = name
        if self.stop and samples.epoch_samples < dp_world_size * local_batch_size:
            raise ConfigError(
                f"{key} = {name!r}: {samples.epoch_samples} sequences, fewer than one global batch "
                f"({dp_world_size} x {local_batch_size}); add data or lower the seq_len or batch size")
        self._start = 0  # the global sample this reading began at (a resume's position)
        self._consumed = 0  # samples this rank has yielded since

    def _global_index(self, consumed: int) -> int:
        k, j = divmod(consumed, self.batch)  # global batch, position in the local batch
        return self._start + k * self.world * self.batch + self.rank * self.batch + j

    def position(self) -> int:
        """Samples of the global order the ranks have read together, once each has read as
        many whole local batches as this one (between steps, every rank has)."""
        return self._start + self._consumed // self.batch * self.world * self.batch

    def seek(self, position: int) -> None:
        """Read on from global sample `position` (a resume, at any degree or batch)."""
        self._start, self._consumed = position, 0

    def _batch_exhausted(self, k: int) -> str | None:
        """Name of a stream that global batch k would take past its first epoch, if any."""
        size = self.world * self.batch
        for g in range(self._start + k * size, self._start + (k + 1) * size):
            name = self.samples.first_exhausted(g)
            if name is not None:
                return name
        return None

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            k, j = divmod(self._consumed, self.batch)
            if self.stop:
                name = self._batch_exhausted(k)
                if name is not None:
                    logger.warning("%s: end of data (%s has no unseen sequences left for global batch %d); "
                                   "stopping, as gamma.data.on_exhausted = \"stop\" asks", self.name, name, k + 1)
                    return
            # The rest of the local batch (all of it, unless a checkpoint was taken mid-batch).
            rows = [self.samples.get(self._global_index(c)) for c in range(self._consumed, (k + 1) * self.batch)]
            window = torch.from_numpy(np.stack(rows).astype(np.int64))
            self._consumed += len(rows)
            yield {"input": window[:, :-1]}, window[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self._consumed, "start": self._start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._consumed = int(state_dict["consumed"])
        self._start = int(state_dict.get("start", 0))  # absent in checkpoints written before seek()
