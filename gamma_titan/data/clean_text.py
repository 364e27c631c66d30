"""Text that is not clean: undecodable bytes, and records whose text is missing, null, not a
string or not JSON at all. One policy for `pretokenize`, `tokenizer train` and the "hf" dataset.

* strict (the default, and always for the "hf" dataset): the source is refused in one line
  naming the file and the line (JSON lines, text) or row (parquet, a JSON array) and what is
  wrong there, with the byte offset of an undecodable byte;
* `--errors replace`: each undecodable byte becomes U+FFFD; records without a string text
  are skipped;
* `--errors skip`: documents with undecodable bytes are skipped, as are records without a
  string text.
Both report what they did (`TextErrors`: documents and bytes), in the summary line and in
the output's meta.json.

`scan_files` reads the files itself, record by record, in the order and with the record
boundaries of the packaged `datasets` builders that read them in strict mode (text: one
record per blank-line-separated paragraph, universal newlines; JSON: one object per line, or
one array; parquet: the `text` column), so both modes see the same documents.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gamma_titan.errors import ConfigError

TEXT_FIELD = "text"
POLICIES = ("strict", "replace", "skip")
#: Lone surrogates are what `surrogateescape` decodes an undecodable byte to (one a byte).
_SURROGATE = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class Record:
    """One record of a file: where it is, its text, or what is wrong with it."""

    file: str
    where: str  # "line 12", "row 3"
    text: str | None  # the text as decoded (undecodable bytes as lone surrogates)
    problem: str | None = None  # a record without a usable text: why
    bad_bytes: int = 0
    first_bad_offset: int | None = None  # byte offset of the first undecodable byte ...
    offset_of: str = "the file"  # ... in the file, or in the record's own text (parquet)

    def describe(self) -> str:
        if self.problem is not None:
            return f"{self.file}: {self.where}: {self.problem}"
        return (f"{self.file}: {self.where}: {self.bad_bytes} byte(s) not UTF-8, the first at byte offset "
                f"{self.first_bad_offset} of {self.offset_of}")


@dataclass
class TextErrors:
    """What a replace/skip pass did: counts for the summary line and meta.json."""

    policy: str
    docs_replaced: int = 0
    bytes_replaced: int = 0
    docs_skipped: dict[str, int] = field(default_factory=dict)
    bytes_skipped: int = 0

    def count_skip(self, reason: str) -> None:
        self.docs_skipped[reason] = self.docs_skipped.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "docs_replaced": self.docs_replaced, "bytes_replaced": self.bytes_replaced,
                "docs_skipped": dict(sorted(self.docs_skipped.items())), "bytes_skipped": self.bytes_skipped}

    def summary(self) -> str:
        skipped = sum(self.docs_skipped.values())
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.docs_skipped.items()))
        line = (f"--errors {self.policy}: {self.docs_replaced} docs with {self.bytes_replaced} undecodable bytes "
                "replaced")
        return line + f"; {skipped} docs skipped" + (f" ({reasons})" if reasons else "")


def check_policy(policy: str, key: str = "--errors") -> str:
    if policy not in POLICIES:
        raise ConfigError(f"{key} {policy}: one of {', '.join(POLICIES)}")
    return policy


# --- reading files record by record ------------------------------------------------------------


def _decode(raw: bytes, offset: int) -> tuple[str, int, int | None]:
    """(text with undecodable bytes as lone surrogates, how many, byte offset of the first)."""
    text = raw.decode("utf-8", "surrogateescape")
    bad = _SURROGATE.findall(text)
    if not bad:
        return text, 0, None
    first = _SURROGATE.search(text).start()
    return text, len(bad), offset + len(text[:first].encode("utf-8", "surrogateescape"))


def _text_records(path: str) -> Iterator[Record]:
    """One record per blank-line-separated paragraph, as `datasets`' text builder with
    sample_by="paragraph" (universal newlines, empty paragraphs dropped)."""
    text, bad, first = _decode(Path(path).read_bytes(), 0)
    for line, paragraph in _paragraphs(text):
        n_bad = len(_SURROGATE.findall(paragraph)) if bad else 0
        # the file's first undecodable byte lies in its first paragraph that has any
        yield Record(path, f"line {line}", paragraph, bad_bytes=n_bad, first_bad_offset=first if n_bad else None)
        if n_bad:
            first = None


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, paragraph) of `text` split as `datasets`' text builder does."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out, line = [], 1
    for part in text.split("\n\n"):
        if part:
            out.append((line + (len(part) - len(part.lstrip("\n"))), part))
        line += part.count("\n") + 2
    return out


def _json_record(path: str, where: str, obj: Any) -> Record:
    if not isinstance(obj, dict):
        return Record(path, where, None, f"not a JSON object ({type(obj).__name__})")
    if TEXT_FIELD not in obj:
        return Record(path, where, None, f"no '{TEXT_FIELD}' field (fields: {', '.join(sorted(obj)) or 'none'})")
    value = obj[TEXT_FIELD]
    if value is None:
        return Record(path, where, None, f"'{TEXT_FIELD}' is null")
    if not isinstance(value, str):
        shown = f"{type(value).__name__} {json.dumps(value)[:40]}"
        return Record(path, where, None, f"'{TEXT_FIELD}' is not a string ({shown})")
    bad = len(_SURROGATE.findall(value))
    return Record(path, where, value, bad_bytes=bad)


def _json_records(path: str) -> Iterator[Record]:
    """One record per line (read line by line: files of any size), or one per item of a
    file that is a single JSON array."""
    with open(path, "rb") as f:
        is_array = f.read(4096).lstrip()[:1] == b"["
    if is_array:
        text, bad, first = _decode(Path(path).read_bytes(), 0)
        if bad:
            yield Record(path, "the array", None, f"{bad} byte(s) not UTF-8, the first at byte offset {first}")
            return
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            yield Record(path, f"line {err.lineno}", None, f"not JSON ({err.msg})")
            return
        for i, obj in enumerate(items):
            yield _json_record(path, f"record {i}", obj)
        return
    offset = 0
    with open(path, "rb") as f:
        for line_no, chunk in enumerate(f, 1):
            start, offset = offset, offset + len(chunk)
            if not chunk.strip():
                continue
            text, bad, first = _decode(chunk, start)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                why = f"not JSON ({err.msg.removesuffix(' at')} at column {err.colno})"
                yield Record(path, f"line {line_no}", None, why)
                continue
            record = _json_record(path, f"line {line_no}", obj)
            if bad and record.text is not None:  # invalid bytes inside the string: offset of the first
                record = Record(path, record.where, record.text, bad_bytes=bad, first_bad_offset=first)
            yield record


def _parquet_records(path: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if TEXT_FIELD not in table.column_names:
        yield Record(path, "the schema", None, f"no '{TEXT_FIELD}' column (columns: {', '.join(table.column_names)})")
        return
    column = table.column(TEXT_FIELD)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            or pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        yield Record(path, "the schema", None, f"'{TEXT_FIELD}' is a {column.type} column, not strings")
        return
    row = 0
    for chunk in column.chunks:
        raw_values = chunk.cast(pa.large_binary()) if not pa.types.is_binary(chunk.type) else chunk
        for value in raw_values.to_pylist():
            if value is None:
                yield Record(path, f"row {row}", None, f"'{TEXT_FIELD}' is null")
            else:
                text, bad, first = _decode(value, 0)
                yield Record(path, f"row {row}", text, bad_bytes=bad, first_bad_offset=first, offset_of="its text")
            row += 1


READERS = {"text": _text_records, "json": _json_records, "parquet": _parquet_records}


#: File suffix -> the packaged `datasets` builder whose record boundaries its reader keeps.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def scan_files(files: tuple[str, ...] | list[str]) -> Iterator[Record]:
    """Every record of `files`, in order, each file read as its suffix says (a folder may
    mix .jsonl, .txt and .parquet files)."""
    for path in files:
        yield from READERS[FILE_BUILDERS[Path(path).suffix.lower()]](path)


def first_problem(files: tuple[str, ...] | list[str]) -> Record | None:
    """The first record strict mode refuses: no usable text, or undecodable bytes."""
    return next((r for r in scan_files(files) if r.problem is not None or r.bad_bytes), None)


def strict_texts(files: tuple[str, ...] | list[str]) -> Iterator[str]:
    """The texts of `files` as strict mode reads them (empty ones included, as the packaged
    builders give them); the first record it refuses raises a one-line ConfigError."""
    for record in scan_files(files):
        if record.problem is not None or record.bad_bytes:
            raise ConfigError(f"{record.describe()}; fix it, or pretokenize it with `gamma-titan pretokenize "
                              "--errors replace|skip` and train on the shards")
        yield record.text


def clean_texts(files: tuple[str, ...] | list[str], errors: TextErrors) -> Iterator[str]:
    """The texts of `files` under `errors.policy` ("replace" or "skip"), counting in `errors`."""
    for record in scan_files(files):
        if record.problem is not None:
            errors.count_skip(_reason(record.problem))
            continue
        if record.bad_bytes:
            if errors.policy == "skip":
                errors.count_skip("undecodable bytes")
                errors.bytes_skipped += record.bad_bytes
                continue
            errors.docs_replaced += 1
            errors.bytes_replaced += record.bad_bytes
            yield _SURROGATE.sub("\ufffd", record.text)
        elif record.text:
            yield record.text


def _reason(problem: str) -> str:
    """A problem's kind, for the counts: the text before its details."""
    return problem.split(" (")[0].replace(f"'{TEXT_FIELD}' ", "text ")
