"""The words of the data layer a user writes in the TOML: dataset names and option choices.

A leaf (it imports nothing): the config check, the dataset registry and the loaders all
read these, so each has one owner and importing it costs nothing.
"""

from __future__ import annotations

# `[training] dataset` / `[validation] dataset` values of our own. TorchTitan lower-cases
# the name before looking it up, and so do we.
HF = "hf"  # text read by TorchTitan's streaming loader (registry.py)
BUILTIN = "builtin"  # the built-in corpus's train split, as shards (builtin_shards.py)
BUILTIN_VALIDATION = "builtin_validation"  # its held-out split
MEMMAP = "memmap"  # your shard folders, or a mixture of them (shard_sources.py)

# The built-in corpus's sources (builtin_corpus.py): "builtin" reads the docs, or a mix of
# them by `[gamma.data] mixture = { docs = w1, code = w2 }`.
BUILTIN_DOCS = "docs"
BUILTIN_CODE = "code"
BUILTIN_SOURCES = (BUILTIN_DOCS, BUILTIN_CODE)

# Datasets read from token shards by our loader rather than TorchTitan's text loader.
SHARD_DATASETS = (BUILTIN, BUILTIN_VALIDATION, MEMMAP)

# `gamma.data.on_exhausted`: at the end of the first epoch, start another or stop.
ON_EXHAUSTED = ("wrap", "stop")


def is_shard_dataset(name: str | None) -> bool:
    """True for the datasets our shard loader reads (name as in the TOML, any case)."""
    return (name or "").lower() in SHARD_DATASETS
