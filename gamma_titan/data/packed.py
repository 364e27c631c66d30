"""Fixed-length samples cut from one token stream, in an order that does not depend on
the data-parallel degree.

Sample i is tokens[i·L : i·L + L + 1] (input = first L, label = last L). Global batch k
is samples k·W·B ... (k+1)·W·B − 1; data-parallel rank r of W, with local batch B, takes
the r-th slice of B. So one process with batch W·B sees exactly the union of what W
processes with batch B see: runs at different FSDP degrees train on the same data,
which is what makes them comparable step by step. After the last sample the stream wraps
to a new epoch (logged), or stops when `infinite=False`.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from gamma_titan.errors import ConfigError


class PackedSequences(IterableDataset, Stateful):
    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        local_batch_size: int,
        infinite: bool = True,
        name: str = "dataset",
    ):
        self.tokens = tokens.to(torch.int64)
        self.seq_len = seq_len
        self.rank, self.world, self.batch = dp_rank, dp_world_size, local_batch_size
        self.infinite = infinite
        self.name = name
        self.n_samples = (len(self.tokens) - 1) // seq_len
        if self.n_samples < dp_world_size * local_batch_size:
            raise ConfigError(
                f"training.dataset = {name!r}: {len(self.tokens)} tokens make {self.n_samples} "
                f"samples of seq_len {seq_len}, fewer than one global batch "
                f"({dp_world_size} x {local_batch_size}); lower training.seq_len or the batch size"
            )
        self._consumed = 0  # samples this rank has yielded

    def _global_index(self, consumed: int) -> int:
        k, j = divmod(consumed, self.batch)  # global batch, position in the local batch
        return k * self.world * self.batch + self.rank * self.batch + j

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        from torchtitan.tools.logging import logger

        while True:
            g = self._global_index(self._consumed)
            epoch, i = divmod(g, self.n_samples)
            if epoch > 0 and not self.infinite:
                return
            if i == 0 and epoch > 0 and self.rank == 0:
                logger.warning(f"{self.name}: starting epoch {epoch + 1} ({self.n_samples} samples each)")
            window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
            self._consumed += 1
            yield {"input": window[:-1]}, window[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self._consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._consumed = int(state_dict["consumed"])
