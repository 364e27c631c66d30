"""From the TOML to a sample sequence: which shard folders a run reads, with which weights.

Datasets read from token shards (the fast path; TorchTitan's text loader is not involved):

  builtin             the built-in corpus, pretokenized once per tokenizer into the cache
                      (builtin_shards.py): its docs source, or its sources mixed by
                      [gamma.data] mixture = { docs = w1, code = w2 }
  builtin_validation  its held-out split (with the same mixture)
  memmap              `dataset_path` is
                        * a shard folder (meta.json inside),
                        * a folder of shard folders, mixed by [gamma.data] mixture
                          (keys: folder names or paths relative to it), or
                        * a mixture file (.toml/.json): `mixture = {folder = weight, ...}`
                          or a bare `{folder = weight}` table, folders relative to the file.

[training] reads the train split (builtin_validation: the validation split); [validation]
reads the validation split of its own dataset_path, or of training.dataset_path when unset,
with the same mixture, in order, one pass (or `validation.steps` batches) each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gamma_titan.data.builtin_shards import ensure_builtin_shards
from gamma_titan.data.mixture_table import MIXTURE_FILE_SUFFIXES, mixture_weights, read_mixture_file
from gamma_titan.data.names import BUILTIN, BUILTIN_DOCS, BUILTIN_SOURCES, BUILTIN_VALIDATION, HF, MEMMAP
from gamma_titan.data.sampling import Mixture, Sequences
from gamma_titan.data.shards import META_FILE, TokenShards, TokenizerInfo, tokenizer_info
from gamma_titan.data.tokenizer import HF_ASSETS_KEY, resolve_tokenizer_path
from gamma_titan.errors import ConfigError


@dataclass(frozen=True)
class ShardSource:
    """One shard folder of a run's data, and its weight in the mixture."""

    name: str
    folder: Path
    weight: float


# --------------------------------------------------------------------------- sources


def _mixture_sources(base: Path, mixture: dict[str, Any], key: str) -> list[ShardSource]:
    sources = []
    for name, weight in mixture_weights(mixture, key).items():
        folder = (base / name).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"{key}.{name}: folder {folder} does not exist")
        if not (folder / META_FILE).is_file():
            raise ConfigError(f"{key}.{name}: {folder} is not a shard folder (no {META_FILE}); "
                              "write one with `gamma-titan pretokenize`")
        sources.append(ShardSource(Path(name).name, folder, weight))
    return sources


def resolve_sources(path: str | None, mixture: dict[str, float], key: str) -> list[ShardSource]:
    """The shard folders (and weights) that `key` (a dataset_path) and the mixture name."""
    if not path:
        raise ConfigError(f"{key}: dataset '{MEMMAP}' needs a shard folder, a folder of them with "
                          "[gamma.data] mixture, or a mixture file")
    base = Path(path).expanduser()
    if not base.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if base.is_file():
        if base.suffix not in MIXTURE_FILE_SUFFIXES:
            raise ConfigError(f"{key}: {path} is a file but not a mixture file ({', '.join(MIXTURE_FILE_SUFFIXES)})")
        if mixture:
            raise ConfigError(f"gamma.data.mixture: set, but {key} is a mixture file too; keep one of them")
        return _mixture_sources(base.parent, read_mixture_file(base, key), f"{key} ({base.name})")
    if (base / META_FILE).is_file():
        if mixture:
            raise ConfigError(f"gamma.data.mixture: set, but {key} = {path} is a single shard folder; "
                              "point it at the folder that holds the mixture's folders")
        return [ShardSource(base.name, base, 1.0)]
    if not mixture:
        raise ConfigError(f"{key}: {path} is not a shard folder (no {META_FILE}); point at one, or mix its "
                          "subfolders with [gamma.data] mixture")
    return _mixture_sources(base, mixture, "gamma.data.mixture")


def builtin_sources(mixture: dict[str, Any], tokenizer_dir: Path) -> list[ShardSource]:
    """The built-in corpus's sources that a mixture names (none: the docs alone)."""
    if not mixture:
        return [ShardSource(BUILTIN, ensure_builtin_shards(tokenizer_dir, BUILTIN_DOCS), 1.0)]
    for name in mixture:
        if name not in BUILTIN_SOURCES:
            raise ConfigError(f"gamma.data.mixture.{name}: the '{BUILTIN}' dataset's sources are "
                              f"{', '.join(BUILTIN_SOURCES)}")
    return [ShardSource(name, ensure_builtin_shards(tokenizer_dir, name), float(weight))
            for name, weight in mixture.items() if weight > 0]


# --------------------------------------------------------------------------- from a job config


def dataset_sources(job_config, section: str, tokenizer_dir: Path) -> tuple[list[ShardSource], str]:
    """(sources, split) that `[section]` ("training" or "validation") reads."""
    cfg = getattr(job_config, section)
    name = cfg.dataset.lower()
    if name in (BUILTIN, BUILTIN_VALIDATION):
        split = "validation" if section == "validation" or name == BUILTIN_VALIDATION else "train"
        if cfg.dataset_path:
            raise ConfigError(f"{section}.dataset_path: must be unset for dataset '{name}' (got "
                              f"'{cfg.dataset_path}'); use dataset = \"{MEMMAP}\" or \"{HF}\" for your own data")
        return builtin_sources(job_config.gamma.data.mixture, tokenizer_dir), split
    path, key = cfg.dataset_path, f"{section}.dataset_path"
    if section == "validation" and not path and job_config.training.dataset_path:
        path, key = job_config.training.dataset_path, "training.dataset_path"
    split = "train" if section == "training" else "validation"
    return resolve_sources(path, job_config.gamma.data.mixture, key), split


def open_samples(job_config, section: str, seq_len: int, tokenizer_dir: str | Path | None = None):
    """The global sample sequence of `[section]`: `Sequences` or `Mixture` (sampling.py)."""
    tokenizer_dir = Path(tokenizer_dir or resolve_tokenizer_path(job_config.model.hf_assets_path))
    tokenizer: TokenizerInfo = tokenizer_info(tokenizer_dir)
    sources, split = dataset_sources(job_config, section, tokenizer_dir)
    cfg, data = getattr(job_config, section), job_config.gamma.data
    key = f"{section}.dataset_path" if cfg.dataset.lower() == MEMMAP else f"{section}.dataset"
    shuffle = data.shuffle and section == "training"
    streams = []
    for i, source in enumerate(sources):
        tokens = TokenShards(source.folder, split, key, tokenizer, HF_ASSETS_KEY)
        label = f"{section} data '{source.name}' ({split} split)"
        streams.append(Sequences(tokens, seq_len, shuffle=shuffle, seed=data.seed + i, name=label, key=key,
                                 source=source.name))
    if len(streams) == 1:
        return streams[0]
    return Mixture(streams, [s.weight for s in sources])
