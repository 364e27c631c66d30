"""Pre-tokenized token shards: the on-disk format, and reading it back memory-mapped.

A shard folder (written by `gamma-titan pretokenize`, see pretokenize.py) holds

    meta.json                     what the shards are: tokenizer, dtype, splits, shard list
    train/00000.bin               the tokens of work unit 0's training documents, raw
    train/00000.idx.npy           int64 offsets of its document starts, then its length
    validation/00000.bin ...      the same for held-out documents

Every document is stored as BOS, its tokens, EOS; a split is the concatenation of its
shards in order, one token stream. Tokens are uint16 when the vocabulary fits, else uint32.
meta.json names the tokenizer by a hash of its tokenizer.json (key order and whitespace do
not count), so shards are never read with a tokenizer other than the one that wrote them.

Opening a split checks every shard's size against meta.json, its index's ends, and BOS/EOS
at its ends, so a truncated or mismatched shard is a one-line error before training starts;
`TokenShards.read` checks each window's ids against the vocabulary, so bytes corrupted in
the middle of a shard stop the run at the first bad window instead of training on garbage.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gamma_titan.data.tokenizer import HF_ASSETS_KEY, TOKENIZER_HINT, tokenizer_vocab_size
from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import damaged, load_npy, load_tokenizer, read_json
from gamma_titan.files import TOKENIZER_FILE

#: What to do about a damaged file of a shard folder.
SHARD_HINT = "run `gamma-titan pretokenize` again to redo the shards (--restart)"

META_FILE = "meta.json"
FORMAT = "gamma-titan-shards"
FORMAT_VERSION = 1
SPLITS = ("train", "validation")


# --------------------------------------------------------------------------- tokenizer identity


@dataclass(frozen=True)
class TokenizerInfo:
    sha256: str  # of tokenizer.json, canonicalised
    vocab_size: int  # ids the embedding needs (largest id + 1)
    bos_id: int
    eos_id: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}


def tokenizer_info(folder: str | Path) -> TokenizerInfo:
    """Identity of the tokenizer in `folder` (tokenizer.json + tokenizer_config.json)."""
    folder = Path(folder).resolve()
    spec = folder / TOKENIZER_FILE
    if not spec.is_file():
        raise ConfigError(f"tokenizer: {folder} has no tokenizer.json")
    stamps = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else None
                   for f in (spec, folder / "tokenizer_config.json"))
    return _tokenizer_info(folder, stamps)


@functools.lru_cache(maxsize=16)
def _tokenizer_info(folder: Path, stamps: tuple) -> TokenizerInfo:
    """Cached per folder and file stamps: planning a recipe checks the same tokenizer for
    every run, and hashing it is most of a config check."""
    from tokenizers import Tokenizer

    spec = folder / TOKENIZER_FILE
    canonical = json.dumps(read_json(spec, TOKENIZER_HINT), sort_keys=True)
    tokenizer = load_tokenizer(spec, TOKENIZER_HINT)
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file, TOKENIZER_HINT) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise damaged(config_file, "holds no JSON object", TOKENIZER_HINT)
    ids = {}
    for role in ("bos", "eos"):
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        ids[role] = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if ids[role] is None:
            raise ConfigError(f"tokenizer: {folder} names no {role}_token in tokenizer_config.json "
                              "(shards mark document boundaries with BOS and EOS)")
    return TokenizerInfo(hashlib.sha256(canonical.encode()).hexdigest(),
                         tokenizer_vocab_size(folder), ids["bos"], ids["eos"])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --------------------------------------------------------------------------- reading


def read_meta(folder: str | Path, key: str) -> dict[str, Any]:
    """meta.json of a shard folder; a one-line ConfigError naming `key` if it is not one."""
    folder = Path(folder)
    path = folder / META_FILE
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} does not exist")
    if not path.is_file():
        raise ConfigError(f"{key}: {folder} is not a shard folder (no {META_FILE}); "
                          "write one with `gamma-titan pretokenize`")
    try:
        meta = read_json(path, SHARD_HINT, keys=("format", "version"))
        if meta["format"] != FORMAT or meta["version"] != FORMAT_VERSION:
            raise damaged(path, f"is not a {FORMAT} v{FORMAT_VERSION} file", SHARD_HINT)
        read_json(path, SHARD_HINT, keys=("tokenizer", "dtype", "splits"))
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None
    return meta


def check_tokenizer(meta: dict[str, Any], folder: Path, tokenizer: TokenizerInfo, tokenizer_key: str) -> None:
    made_with = meta["tokenizer"]
    if made_with["vocab_size"] != tokenizer.vocab_size:
        raise ConfigError(
            f"{tokenizer_key}: the tokenizer has {tokenizer.vocab_size} tokens but the shards in "
            f"{folder} were written with a {made_with['vocab_size']}-token tokenizer; "
            "use that tokenizer or pretokenize again")
    if made_with["sha256"] != tokenizer.sha256:
        raise ConfigError(
            f"{tokenizer_key}: the tokenizer (sha256 {tokenizer.sha256[:12]}) is not the one the shards in "
            f"{folder} were written with (sha256 {made_with['sha256'][:12]}); "
            "use that tokenizer or pretokenize again")


class TokenShards:
    """One split of a shard folder as a single read-only token stream."""

    def __init__(self, folder: str | Path, split: str, key: str = "dataset_path",
                 tokenizer: TokenizerInfo | None = None, tokenizer_key: str = HF_ASSETS_KEY):
        self.folder = Path(folder)
        meta = read_meta(self.folder, key)
        if tokenizer is not None:
            check_tokenizer(meta, self.folder, tokenizer, tokenizer_key)
        if split not in meta["splits"]:
            raise ConfigError(f"{key}: {self.folder} has no '{split}' split "
                              f"(has {', '.join(meta['splits']) or 'none'})")
        self.split = split
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size = meta["tokenizer"]["vocab_size"]
        self.bos_id, self.eos_id = meta["tokenizer"]["bos_id"], meta["tokenizer"]["eos_id"]
        info = meta["splits"][split]
        self.n_docs = info["docs"]
        self.files = [self.folder / s["file"] for s in info["shards"] if s["tokens"] > 0]
        sizes = [s["tokens"] for s in info["shards"] if s["tokens"] > 0]
        self._arrays = [self._open(f, n, key) for f, n in zip(self.files, sizes)]
        self._starts = [0, *itertools.accumulate(sizes)]  # shard k holds stream[starts[k]:starts[k+1]]
        if self._starts[-1] != info["tokens"]:
            raise ConfigError(f"{key}: {self.folder / META_FILE} is inconsistent: the '{split}' shards "
                              f"sum to {self._starts[-1]} tokens, not {info['tokens']}")

    def _open(self, path: Path, tokens: int, key: str) -> np.ndarray:
        expected = tokens * self.dtype.itemsize
        if not path.is_file():
            raise ConfigError(f"{key}: shard {path} is missing; run `gamma-titan pretokenize` again to redo it")
        size = path.stat().st_size
        if size != expected:
            raise ConfigError(f"{key}: shard {path} has {size} bytes, expected {expected} "
                              "(truncated or corrupt); run `gamma-titan pretokenize` again to redo it")
        index = path.with_suffix(".idx.npy")
        try:
            offsets = load_npy(index, SHARD_HINT, mmap=True)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        # A plain ndarray view of the mapping: np.memmap's subclass hooks cost more than the read.
        tokens_ = np.memmap(path, dtype=self.dtype, mode="r").view(np.ndarray)
        ok = (offsets.ndim == 1 and len(offsets) >= 2 and offsets[0] == 0 and offsets[-1] == tokens
              and tokens_[0] == self.bos_id and tokens_[-1] == self.eos_id
              and bool((np.diff(offsets) >= 2).all()))  # every document holds at least BOS and EOS
        if not ok:
            raise ConfigError(f"{key}: shard {path} and its index {index} do not agree "
                              "(corrupt); run `gamma-titan pretokenize` again to redo it")
        return tokens_

    def __len__(self) -> int:
        return self._starts[-1]

    def read(self, start: int, stop: int) -> np.ndarray:
        """stream[start:stop] as a new array (it may span shards); ids checked against the vocab."""
        first = bisect.bisect_right(self._starts, start) - 1
        pieces, pos, k = [], start, first
        while pos < stop:
            lo = pos - self._starts[k]
            hi = min(stop, self._starts[k + 1]) - self._starts[k]
            pieces.append(self._arrays[k][lo:hi])
            pos = self._starts[k] + hi
            k += 1
        out = pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)
        if len(out) and int(out.max()) >= self.vocab_size:
            shard = " + ".join(str(f) for f in self.files[first:k])
            raise RuntimeError(f"shard {shard} holds token id {int(out.max())} >= vocab size "
                               f"{self.vocab_size} near stream offset {start}: the file is corrupt; "
                               "run `gamma-titan pretokenize` again to redo it")
        return out

    def documents(self) -> list[np.ndarray]:
        """Every document's tokens (BOS ... EOS), in stream order. For tests and tools."""
        docs = []
        for path, tokens in zip(self.files, self._arrays):
            offsets = np.load(path.with_suffix(".idx.npy"))
            docs += [np.asarray(tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
        return docs
