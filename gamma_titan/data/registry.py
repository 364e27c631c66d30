"""Our text datasets in TorchTitan's own dataset registry, and the check of a dataset choice.

TorchTitan's `build_text_dataloader`, `build_text_validation_dataloader` and validator look
datasets up by name in `torchtitan.hf_datasets.text_datasets.DATASETS`. Adding entries there
(rather than writing our own dataloader) keeps TorchTitan's tokenise-and-pack loop,
checkpointable state and per-rank sharding unchanged. Each entry is a `DatasetConfig`:
`loader(path)` returns a `datasets.Dataset` (map-style, resumed by sample index) or
`IterableDataset` (streaming), and `sample_processor(sample)` returns the sample's text.
TorchTitan passes `training.dataset_path` (or `validation.dataset_path`) to the loader, or
`DatasetConfig.path` when that is unset, and lower-cases the dataset name.

Our entry is "hf": your data, `dataset_path` being any text source (text_sources.py). The
shard datasets ("builtin", "builtin_validation", "memmap") are not text datasets and are not
registered: our loader reads them (shard_sources.py, loader.py). `check_dataset` knows both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

from gamma_titan.data.names import HF, SHARD_DATASETS
from gamma_titan.data.text_sources import TEXT_FIELD, load_source, looks_local, parse_source
from gamma_titan.errors import ConfigError


def _text_of(sample: dict[str, Any]) -> str:
    try:
        text = sample[TEXT_FIELD]
    except KeyError:
        # Only reachable for streamed hub data whose columns were unknown up front.
        raise ConfigError(
            f"dataset record has no '{TEXT_FIELD}' field (fields: {sorted(sample)}); "
            f"the '{HF}' dataset reads the '{TEXT_FIELD}' field"
        ) from None
    if not isinstance(text, str):  # streamed hub data (local sources are checked before training)
        raise ConfigError(f"a dataset record's '{TEXT_FIELD}' is {'null' if text is None else type(text).__name__}, "
                          f"not a string; the '{HF}' dataset reads strings only")
    return text


#: Records of a streamed hub source that pre-flight reads.
HUB_RECORDS_CHECKED = 8


def check_hf_source(path: str, key: str) -> None:
    """Open an "hf" source before training: a local one whole (every record's text a valid
    UTF-8 string: text_sources.load_source), a hub stream by its first records; one-line
    ConfigError naming `key` otherwise."""
    import itertools

    source = parse_source(path, key)
    try:
        ds = load_source(source, path, key)
        first = list(itertools.islice(iter(ds), HUB_RECORDS_CHECKED)) if source.kind == "hub" else []
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001  (the hub, the network, a format datasets rejects)
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(f"{key}: '{path}': cannot read its first records ({type(err).__name__}: {detail})") from None
    for i, record in enumerate(first):
        text = record.get(TEXT_FIELD)
        if not isinstance(text, str):
            what = "no" if TEXT_FIELD not in record else "null" if text is None else f"a {type(text).__name__}"
            raise ConfigError(f"{key}: '{path}': record {i} has {what} '{TEXT_FIELD}' (the '{HF}' dataset reads "
                              "strings)")


def _load_hf(path: str) -> Any:
    """TorchTitan's loader, in every rank: pre-flight (check_hf_source) has read local files
    through; a record that went bad since raises its one line as the stream reaches it."""
    return load_source(parse_source(path), path, checked=True)


_OUR_DATASETS = {
    # Empty default path: the loader then reports that dataset_path is required.
    HF: DatasetConfig(path="", loader=_load_hf, sample_processor=_text_of),
}


def register_datasets() -> None:
    """Add our entries to TorchTitan's registry (idempotent; needed in every process)."""
    DATASETS.update(_OUR_DATASETS)


def check_dataset(name: str, path: str | None, key: str) -> None:
    """Validate a dataset choice before training starts; raise a one-line ConfigError.

    `key` is the config section, "training" or "validation" (a full key such as
    "training.dataset_path" is accepted too); messages name `<key>.dataset` or
    `<key>.dataset_path`.
    """
    register_datasets()
    section = key.removesuffix(".dataset_path").removesuffix(".dataset")
    name_key, path_key = f"{section}.dataset", f"{section}.dataset_path"
    lowered = (name or "").lower()  # TorchTitan lower-cases the name too

    if lowered not in DATASETS and lowered not in SHARD_DATASETS:
        raise ConfigError(
            f"{name_key}: unknown dataset '{name}'; "
            f"allowed: {', '.join(sorted({*DATASETS, *SHARD_DATASETS}))}"
        )
    if lowered in SHARD_DATASETS:
        return  # needs the whole job config: shard_sources.open_samples checks it
    if lowered == HF:
        parse_source(path, path_key)
        return

    # TorchTitan's own entries (c4, c4_test, ...): their loaders take a local path or a
    # hub repo id; catch a local path that is missing (c4_test's default is relative).
    effective = path or DATASETS[lowered].path
    if Path(effective).expanduser().exists():
        return
    if looks_local(effective) or not re.fullmatch(r"[\w.-]+/[\w.-]+", effective):
        raise ConfigError(
            f"{path_key}: dataset '{lowered}' reads '{effective}', which does not exist; "
            f'set {path_key} or use dataset = "builtin"'
        )
