"""Text sources: where a path names documents, and opening them as a `datasets` dataset.

One grammar serves the "hf" dataset's `dataset_path`, `gamma-titan pretokenize --input` and
`gamma-titan tokenizer train --input`. A source is one of
  * a local .jsonl / .json / .parquet / .txt file,
  * a local folder of such files (searched recursively; kinds may mix, each file is read
    as its suffix says),
  * a local folder written by `Dataset.save_to_disk` (`folder:split` picks a split of a
    saved DatasetDict),
  * a hub dataset id `owner/name`, `owner/name/config`, each optionally followed by
    `:split` (default split "train"); streamed.
Records must have a "text" field; other fields are dropped. A .txt file gives one record per
blank-line-separated paragraph.

`parse_source` decides which one a string is without loading anything (one-line errors
naming the config key); `load_source` opens it. Local data never touches the network, with
or without HF_DATASETS_OFFLINE=1, and is read where it is: files are streamed by
clean_text.py's readers (the packaged json/parquet/text builders' records, nothing
converted, nothing copied into a cache), a save_to_disk folder memory-mapped by
`load_from_disk`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gamma_titan.data.clean_text import FILE_BUILDERS
from gamma_titan.data.names import HF
from gamma_titan.errors import ConfigError

TEXT_FIELD = "text"

_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(?P<config>[\w.-]+))?")
_SPLIT = re.compile(r"[A-Za-z0-9][\w.-]*")

_SOURCE_HELP = (
    "use a local .jsonl/.json/.parquet/.txt file or folder, a save_to_disk folder, "
    "or a hub id owner/name[/config][:split]"
)


@dataclass(frozen=True)
class TextSource:
    """Where a source string points, decided without loading anything."""

    kind: str  # "files" | "saved" | "hub"
    location: str  # local path, or hub repo id "owner/name"
    files: tuple[str, ...] = ()  # data files for kind "files", each read as its suffix says
    config: str | None = None  # hub config name
    split: str | None = None  # hub split / saved DatasetDict split


def parse_source(value: str | None, key: str = "dataset_path") -> TextSource:
    """Classify a source string; raise a one-line ConfigError naming `key` if unusable."""
    value = (value or "").strip()
    if not value:
        raise ConfigError(f"{key}: the '{HF}' dataset needs a path; {_SOURCE_HELP}")

    base, split = value, None
    if ":" in value and not Path(value).expanduser().exists():
        head, tail = value.rsplit(":", 1)
        if _SPLIT.fullmatch(tail):
            base, split = head, tail

    local = Path(base).expanduser()
    if local.exists():
        return _local_source(local, split, value, key)
    if looks_local(base):
        raise ConfigError(f"{key}: '{value}' does not exist; {_SOURCE_HELP}")
    match = _HUB_ID.fullmatch(base)
    if not match:
        raise ConfigError(
            f"{key}: '{value}' is neither an existing local path nor a hub dataset id; "
            + _SOURCE_HELP
        )
    return TextSource("hub", match["repo"], config=match["config"], split=split or "train")


def looks_local(value: str) -> bool:
    """Strings that can only mean a local path (so a missing one is an error, not a hub id)."""
    if value.startswith(("/", "./", "../", "~")) or Path(value).suffix in FILE_BUILDERS:
        return True
    first = value.split("/", 1)[0]
    return "/" in value and Path(first).is_dir()  # e.g. "data/foo" when ./data exists


def _is_saved_dataset(folder: Path) -> bool:
    """Folders written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _local_source(local: Path, split: str | None, value: str, key: str) -> TextSource:
    if local.is_dir() and _is_saved_dataset(local):
        return TextSource("saved", str(local), split=split)
    if split is not None:
        raise ConfigError(
            f"{key}: '{value}': ':{split}' only applies to hub ids and save_to_disk folders; "
            "point at the file or folder of that split instead"
        )
    if local.is_file():
        builder = FILE_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"{key}: '{value}' has an unsupported file type; "
                f"allowed: {', '.join(FILE_BUILDERS)}"
            )
        return _nonempty(TextSource("files", str(local), (str(local),)), value, key)

    files = sorted(
        p
        for p in local.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FILE_BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(local).parts)
    )
    if not files:
        raise ConfigError(
            f"{key}: folder '{value}' has no {'/'.join(FILE_BUILDERS)} files "
            "and is not a save_to_disk folder"
        )
    return _nonempty(TextSource("files", str(local), tuple(str(p) for p in files)), value, key)


def _nonempty(source: TextSource, value: str, key: str) -> TextSource:
    if all(os.path.getsize(f) == 0 for f in source.files):  # `datasets` fails obscurely on these
        raise ConfigError(f"{key}: '{value}' is empty (no documents)")
    return source


def load_source(source: TextSource, value: str, key: str = "dataset_path", checked: bool = False) -> Any:
    """Open a parsed source as a `datasets.IterableDataset` (local files, a hub id) or
    `Dataset` (a save_to_disk folder). Local text that is not clean (clean_text.py:
    undecodable bytes, a null or non-string text, a line that is not JSON) is refused in one
    line naming `key`, the file and the line: files are read through once here unless
    `checked` (pre-flight read them), and a record refused while streaming raises the same
    line."""
    # Imported here: `datasets` takes seconds to import, and parsing a source needs none of it.
    from datasets import DatasetDict, Features, IterableDataset, Value, load_dataset, load_from_disk

    if source.kind == "files":
        if not checked:
            problem = _unclean(source, value, key)
            if problem is not None:
                raise problem
        # One shard per file (TorchTitan splits a stream by shards across data-parallel ranks).
        ds = IterableDataset.from_generator(_file_records, gen_kwargs={"files": list(source.files)},
                                            features=Features({TEXT_FIELD: Value("string")}))
    elif source.kind == "saved":
        ds = load_from_disk(source.location)
        if isinstance(ds, DatasetDict):
            split = source.split or "train"
            if split not in ds:
                raise ConfigError(
                    f"dataset_path '{value}': no split '{split}'; "
                    f"available: {', '.join(ds)} (write it as '<folder>:<split>')"
                )
            ds = ds[split]
    else:
        # Streaming: nothing is downloaded up front, and TorchTitan checkpoints the stream.
        ds = load_dataset(source.location, name=source.config, split=source.split, streaming=True)
    ds = _keep_text_column(ds, value)
    if source.kind == "saved":
        _check_text_column(ds, source, value, key)
    return ds


def _file_records(files: list[str]):
    """The records of local files, streamed (IterableDataset.from_generator's shards)."""
    from gamma_titan.data.clean_text import strict_texts

    for text in strict_texts(files):
        yield {TEXT_FIELD: text}


def _unclean(source: TextSource, value: str, key: str) -> ConfigError | None:
    """The one-line error for local files strict mode refuses (their first bad record), or
    None: every record is clean."""
    from gamma_titan.data.clean_text import first_problem

    problem = first_problem(source.files)
    if problem is None:
        return None
    hint = ("or pass --errors replace|skip" if key.startswith("--") else
            "or pretokenize it with `gamma-titan pretokenize --errors replace|skip` and train on the shards")
    return ConfigError(f"{key}: {problem.describe()}; fix it, {hint}")


def _check_text_column(ds: Any, source: TextSource, value: str, key: str) -> None:
    """Every record's text a valid UTF-8 string: the column's type, its nulls and its bytes."""
    import pyarrow as pa

    feature = ds.features[TEXT_FIELD]
    dtype = getattr(feature, "dtype", None)
    column = ds.data.column(TEXT_FIELD)
    bad = None
    if dtype not in ("string", "large_string"):
        bad = f"the '{TEXT_FIELD}' column holds {dtype or type(feature).__name__}, not strings"
    elif column.null_count:
        bad = f"record {_first_null(column)}: '{TEXT_FIELD}' is null"
    else:
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            bad = "a record's text is not valid UTF-8"
    if bad is None:
        return
    raise ConfigError(f"{key}: '{value}': {bad}; fix it (`datasets` map/filter) and save it again")


def _first_null(column: Any) -> int:
    import pyarrow.compute as pc

    return pc.index(pc.is_null(column), True).as_py()


def _keep_text_column(ds: Any, value: str) -> Any:
    columns = ds.column_names  # None for a stream whose features are not declared
    if columns is None:
        return ds
    if TEXT_FIELD not in columns:
        raise ConfigError(
            f"dataset_path '{value}': no '{TEXT_FIELD}' column (columns: {', '.join(columns)}); "
            f"the '{HF}' dataset reads the '{TEXT_FIELD}' column"
        )
    return ds.select_columns([TEXT_FIELD]) if len(columns) > 1 else ds
