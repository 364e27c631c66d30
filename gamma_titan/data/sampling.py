"""The global sequence of training samples: which window of which token stream is sample g.

Both classes map a global sample index g = 0, 1, 2, ... to L + 1 tokens (input = first L,
labels = last L) in O(1), with no state: a data-parallel rank computes only its own
samples, and resuming needs nothing but g.

  Sequences  one token stream cut into n = (len - 1) // L windows at stride L (a window's
             last token is the next window's first); epoch e is a permutation of them
             seeded by (seed, e), or in order without shuffling.
  Mixture    several `Sequences` interleaved with fixed weights. A table of PERIOD slots
             places source s's k-th draw at about (k + 1/2) / w_s, so every prefix of the
             sequence holds each source within one sample of its weight; source s's k-th
             draw is its own sample k (its epochs wrap independently: a small source
             repeats, a large one is not fully seen).

`first_exhausted(g)` tells where the first epoch ends: None while sample g lies in the
first epoch of every stream, else the name of the stream that has wrapped. That is what
`on_exhausted = "stop"` and one-pass validation stop on.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from gamma_titan.errors import ConfigError

logger = logging.getLogger(__name__)

PERIOD = 1 << 16  # mixture table length: weights are realised exactly to 1 / PERIOD


class Sequences:
    def __init__(self, tokens, seq_len: int, *, shuffle: bool, seed: int, name: str, key: str, source: str = ""):
        self.tokens, self.seq_len, self.shuffle, self.seed, self.name = tokens, seq_len, shuffle, seed, name
        self.source = source or name  # the source's short name (per-source validation losses)
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise ConfigError(f"{key}: {name} has {len(tokens)} tokens, not enough for one sequence of "
                              f"seq_len {seq_len}; add data or lower the seq_len")
        self._perms: dict[int, np.ndarray] = {}
        self._epochs_seen = 0

    def window(self, k: int) -> np.ndarray:
        """The k-th draw of this stream (k may run past the first epoch)."""
        epoch, i = divmod(k, self.n)
        if epoch > self._epochs_seen:
            self._epochs_seen = epoch
            logger.warning("%s: all %d sequences seen, starting epoch %d", self.name, self.n, epoch + 1)
        if self.shuffle:
            i = int(self._permutation(epoch)[i])
        start = i * self.seq_len
        return self.tokens.read(start, start + self.seq_len + 1)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # keep the current epoch and its neighbour
                del self._perms[min(self._perms)]
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            # int32 while it fits: 4 bytes per sequence (1T tokens at L = 4096: 1 GB)
            self._perms[epoch] = rng.permutation(self.n).astype(np.int32 if self.n < 2**31 else np.int64)
        return self._perms[epoch]

    def get(self, g: int) -> np.ndarray:
        return self.window(g)

    def first_exhausted(self, g: int) -> str | None:
        return self.name if g >= self.n else None

    @property
    def epoch_samples(self) -> int:
        return self.n

    @property
    def source_names(self) -> list[str]:
        return [self.source]


class Mixture:
    def __init__(self, sources: list[Sequences], weights: list[float]):
        total = float(sum(weights))
        self.sources = sources
        self.weights = [w / total for w in weights]
        # Slot positions (k + 1/2) / w of every source's draws, merged: source s gets
        # round(w_s · PERIOD) slots, spread evenly; ties go to the earlier source.
        slots, owners = [], []
        for s, w in enumerate(self.weights):
            if w > 0:
                count = math.ceil(w * PERIOD) + 1
                slots.append((np.arange(count) + 0.5) / w)
                owners.append(np.full(count, s))
        order = np.lexsort((np.concatenate(owners), np.concatenate(slots)))[:PERIOD]
        self.table = np.concatenate(owners)[order]  # slot -> source
        self.per_period = np.bincount(self.table, minlength=len(sources))  # draws per period
        # rank of each slot among its source's slots in the period
        self.rank = np.empty(PERIOD, dtype=np.int64)
        for s in range(len(sources)):
            where = np.flatnonzero(self.table == s)
            self.rank[where] = np.arange(len(where))

    def locate(self, g: int) -> tuple[int, int]:
        """(source, draw k of that source) of global sample g."""
        period, slot = divmod(g, PERIOD)
        s = int(self.table[slot])
        return s, period * int(self.per_period[s]) + int(self.rank[slot])

    def get(self, g: int) -> np.ndarray:
        s, k = self.locate(g)
        return self.sources[s].window(k)

    def first_exhausted(self, g: int) -> str | None:
        s, k = self.locate(g)
        return self.sources[s].first_exhausted(k)

    @property
    def source_names(self) -> list[str]:
        return [s.source for s in self.sources]

    @property
    def epoch_samples(self) -> int:
        """Samples until the first source wraps (approximately: the weight decides)."""
        return min(int(src.n / w) for src, w in zip(self.sources, self.weights) if w > 0)
