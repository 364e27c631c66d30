"""`gamma-titan pretokenize`: text -> token shards, in several processes, resumable.

The input is read in work units of `docs_per_shard` documents. Each unit is tokenized by a
worker process and written as one shard per split (its held-out documents, chosen by a hash
of their text, go to the validation split), then recorded in `.progress/`. A rerun skips
every recorded unit whose files are intact and whose texts are the same (a record keeps
their sha256), so an interrupted run resumes where it stopped, an edited input redoes the
units it changed, and a finished run reads its input again and writes no shard; meta.json,
written last, marks the folder complete. The unit layout does not depend on the number of
processes, so neither does the output. The inputs are opened, and strictly checked, before
anything is written; a call that fails before any unit is done leaves nothing behind (a
folder holding only a plan is replaced by the next call, whatever its settings). A folder
holding shards of other settings is refused, or with `restart` emptied of them (and only
them) once the new inputs are open, then written afresh. A `val_fraction` that would hold
out none of the input's documents (without a `val_input`) is refused before anything is
written, naming the least fraction that holds one out.

Text that is not clean (clean_text.py) is refused in one line, or with `errors` "replace" /
"skip" cleaned while it is read (local files only), the counts in the summary and meta.json.

Tokenization happens in the workers, one thread each (TOKENIZERS_PARALLELISM=false):
`num_proc` is the parallelism, and the throughput per process is what it reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gamma_titan.data.cache import write_json_atomic
from gamma_titan.data.clean_text import TextErrors, check_policy, clean_texts
from gamma_titan.data.shards import FORMAT, FORMAT_VERSION, META_FILE, SPLITS, TokenizerInfo, token_dtype, tokenizer_info
from gamma_titan.data.text_sources import TEXT_FIELD, load_source, parse_source
from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import read_json
from gamma_titan.files import TOKENIZER_FILE

PROGRESS_DIR = ".progress"
PLAN_FILE = "plan.json"
DEFAULT_DOCS_PER_SHARD = 20_000
#: Documents a worker encodes at once. A tokenizers Encoding holds offsets, token strings and
#: masks besides the ids (about 150 bytes a token): a whole unit of 20,000 web documents at
#: once held 3 GB per worker. Each document's ids are kept as token_dtype (2 bytes a token).
ENCODE_BATCH_DOCS = 1_000
#: What to do about a damaged plan.json of an --out folder.
PLAN_HINT = "rerun with --restart to write the folder again"

# The two inputs: documents of --input go to train (or, by hash, to validation); documents
# of --val-input all go to validation. The tag prefixes their shard names.
INPUT_TAGS = {"input": "", "val_input": "heldout-"}


@dataclass
class Result:
    meta: dict[str, Any]
    units_encoded: int  # work units tokenized by this call
    units_skipped: int  # already done by an earlier call
    tokens_encoded: int
    seconds: float
    num_proc: int
    text_errors: TextErrors | None = None

    def summary(self) -> str:
        splits = ", ".join(f"{name} {s['docs']} docs / {s['tokens']} tokens"
                           for name, s in self.meta["splits"].items())
        line = f"{splits}; {self.units_encoded} shards written, {self.units_skipped} already done"
        if self.units_encoded:
            rate = self.tokens_encoded / self.seconds
            line += (f"; {self.tokens_encoded} tokens in {self.seconds:.1f} s = {rate:,.0f} tokens/s "
                     f"({rate / self.num_proc:,.0f} per process, {self.num_proc} processes)")
        if self.text_errors is not None:
            line += f"; {self.text_errors.summary()}"
        return line


def is_validation(text: str, fraction: float) -> bool:
    """Held-out by content: the same text always lands in the same split."""
    return fraction > 0 and held_out_rank(text) < fraction


def held_out_rank(text: str) -> float:
    """Where the text's hash falls in [0, 1): it is held out by any fraction above it."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _check_holds_out(texts: Iterator[str], val_fraction: float) -> None:
    """Refuse a fraction that holds out none of the documents (the validation split would be
    empty, which training refuses later): read until one is held out (soon, on any input of
    more than a few times 1/fraction documents), else name the least fraction that would."""
    least, count = 1.0, 0
    for text in texts:
        count += 1
        rank = held_out_rank(text)
        if rank < val_fraction:
            return
        least = min(least, rank)
    if count:
        step = 10.0 ** (math.floor(math.log10(least)) - 1)  # 2 significant digits, rounded up past it
        needed = (math.floor(least / step) + 1) * step
        fraction = f"use --val-fraction {needed:.2g} or more, or " if needed < 1 else ""
        raise ConfigError(f"--val-fraction {val_fraction}: none of the {count} documents of --input is held out "
                          f"(each is by a hash of its text); {fraction}give the validation documents with "
                          "--val-input")


def _texts(ds, docs_per_shard: int) -> Iterator[str]:
    """The texts of an opened input, in order (a fresh pass; for a cleaned stream, one that
    does not count into the run's error counts)."""
    if isinstance(ds, _CleanStream):
        ds = _CleanStream(ds.files, TextErrors(ds.errors.policy))
    for batch in ds.iter(batch_size=docs_per_shard):
        yield from (t for t in batch[TEXT_FIELD] if isinstance(t, str))


# --------------------------------------------------------------------------- worker side

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, info: TokenizerInfo, out: str, val_fraction: float) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if multiprocessing.parent_process() is not None:  # a pool worker: Ctrl-C is the parent's to handle
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_file(tokenizer_file), info=info, out=Path(out),
                   dtype=token_dtype(info.vocab_size), val_fraction=val_fraction)


def _encode_unit(tag: str, unit: int, texts: list[str], heldout: bool, digest: str) -> dict[str, Any]:
    """Tokenize one unit and write its shards; returns its progress record."""
    w = _worker
    docs: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    for start in range(0, len(texts), ENCODE_BATCH_DOCS):
        batch = texts[start:start + ENCODE_BATCH_DOCS]
        for text, enc in zip(batch, w["tokenizer"].encode_batch(batch, add_special_tokens=False)):
            split = "validation" if heldout or is_validation(text, w["val_fraction"]) else "train"
            docs[split].append(np.asarray(enc.ids, dtype=w["dtype"]))
    record: dict[str, Any] = {"tag": tag, "unit": unit, "docs_in": len(texts), "texts_sha256": digest, "splits": {}}
    for split, ids in docs.items():
        if ids:
            record["splits"][split] = _write_shard(w["out"], f"{split}/{tag}{unit:05d}", ids,
                                                   w["info"], w["dtype"])
    return record


def _write_shard(out: Path, stem: str, docs: list[np.ndarray], info: TokenizerInfo, dtype) -> dict[str, Any]:
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) + 2 for d in docs])
    tokens = np.empty(int(offsets[-1]), dtype=dtype)
    for start, ids in zip(offsets[:-1], docs):
        tokens[start] = info.bos_id
        tokens[start + 1 : start + 1 + len(ids)] = ids
        tokens[start + 1 + len(ids)] = info.eos_id
    path = out / f"{stem}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tokens.tofile(tmp)
    with open(path.with_name(f".{path.stem}.idx.npy.tmp"), "wb") as f:
        np.save(f, offsets)
    os.replace(path.with_name(f".{path.stem}.idx.npy.tmp"), path.with_suffix(".idx.npy"))
    os.replace(tmp, path)  # last: a .bin without its index never exists
    return {"file": f"{stem}.bin", "tokens": len(tokens), "docs": len(docs),
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}


# --------------------------------------------------------------------------- main side


def _unit_is_intact(out: Path, record: dict[str, Any], dtype: np.dtype) -> bool:
    for shard in record["splits"].values():
        path = out / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["tokens"] * dtype.itemsize:
            return False
        if not path.with_suffix(".idx.npy").is_file():
            return False
    return True


def _check_out(out: Path, plan: dict[str, Any], restart: bool) -> bool:
    """`out` must be empty, a folder this same plan started (resume) or finished, or one an
    earlier call planned without finishing any unit (replaced); one of other settings only
    with `restart`. Returns whether its shards are to be removed (restart)."""
    plan_file = out / PROGRESS_DIR / PLAN_FILE
    if plan_file.is_file():
        previous = {"errors": "strict", **read_json(plan_file, PLAN_HINT, keys=())}  # before --errors
        changed = sorted(k for k in plan.keys() | previous.keys() if plan.get(k) != previous.get(k))
        if changed and _holds_units(out):
            if restart:
                return True
            raise ConfigError(f"--out: {out} holds shards written with other settings "
                              f"({', '.join(changed)} differ); add --restart to replace them, "
                              "or use a new --out folder")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} exists and is not an empty folder or a pretokenize output; "
                          "use a new --out folder")
    return False


def _remove_output(out: Path) -> None:
    """What pretokenize wrote in `out` (shards, progress records, meta.json), nothing else."""
    for split in SPLITS:
        shutil.rmtree(out / split, ignore_errors=True)
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    (out / META_FILE).unlink(missing_ok=True)


def _holds_units(out: Path) -> bool:
    """Whether an earlier call finished a unit (a progress record or a shard) in `out`."""
    records = [p for p in (out / PROGRESS_DIR).glob("*.json") if p.name != PLAN_FILE]
    return bool(records) or any((out / split).is_dir() and any((out / split).iterdir()) for split in SPLITS)


class _CleanStream:
    """A local source read by clean_text under a replace/skip policy, shaped like a streamed
    `datasets` dataset (`iter(batch_size)`); every pass counts into `errors` afresh."""

    def __init__(self, files: tuple[str, ...], errors: TextErrors):
        self.files, self.errors = files, errors

    def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
        batch: list[str] = []
        for text in clean_texts(self.files, self.errors):
            batch.append(text)
            if len(batch) == batch_size:
                yield {TEXT_FIELD: batch}
                batch = []
        if batch:
            yield {TEXT_FIELD: batch}


def _open_input(source_value: str, key: str, docs_per_shard: int, errors: TextErrors | None):
    """(dataset, number of units or None for a stream) of a text source, opened once and
    (strict) checked; with `errors`, a local source read through its policy."""
    from datasets import Dataset

    source = parse_source(source_value, key)
    if errors is not None:
        if source.kind != "files":
            raise ConfigError(f"{key}: --errors {errors.policy} reads local .txt/.jsonl/.json/.parquet files; "
                              f"'{source_value}' is a {'hub' if source.kind == 'hub' else 'save_to_disk'} source, "
                              "read strictly (leave --errors out)")
        return _CleanStream(source.files, errors), None
    ds = load_source(source, source_value, key)
    return ds, (-(-len(ds) // docs_per_shard) if isinstance(ds, Dataset) else None)


@contextlib.contextmanager
def _datasets_progress(enabled: bool) -> Iterator[None]:
    """`datasets`' own progress bars (converting a file to arrow) on or off for a block."""
    from datasets.utils import logging as datasets_logging

    was = datasets_logging.is_progress_bar_enabled()
    (datasets_logging.enable_progress_bar if enabled else datasets_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (datasets_logging.enable_progress_bar if was else datasets_logging.disable_progress_bar)()


def _units(ds, n_units: int | None, docs_per_shard: int, done: dict[int, str | None], key: str,
           seen: list[int]) -> Iterator[tuple[int, list[str], str]]:
    """(unit, texts, their sha256) of every unit not in `done` with the same texts (a record
    written before the hashes were kept counts as the same); the number of units the input
    has is appended to `seen` once it is read to its end."""
    if n_units is not None:  # random access
        batches = (ds[unit * docs_per_shard : (unit + 1) * docs_per_shard][TEXT_FIELD] for unit in range(n_units))
    else:  # a stream: read it all
        batches = (batch[TEXT_FIELD] for batch in ds.iter(batch_size=docs_per_shard))
    count = 0
    for unit, texts in enumerate(batches):
        count = unit + 1
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:  # a stream's record (a hub dataset is checked as it is read)
            raise ConfigError(f"{key}: record {unit * docs_per_shard + bad}: '{TEXT_FIELD}' is "
                              f"{'null' if texts[bad] is None else type(texts[bad]).__name__}, not a string")
        digest = hashlib.sha256("\0".join(texts).encode("utf-8", "surrogatepass")).hexdigest()
        if unit not in done or done[unit] not in (None, digest):  # None: recorded before hashes were kept
            yield unit, texts, digest
    seen.append(count)


def pretokenize(
    input: str,
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    val_input: str | None = None,
    val_fraction: float = 0.0,
    num_proc: int = 1,
    docs_per_shard: int = DEFAULT_DOCS_PER_SHARD,
    progress: bool = True,
    errors: str = "strict",
    restart: bool = False,
) -> Result:
    """Tokenize `input` (and `val_input`) into shards in `out`; see the module docstring."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if num_proc < 1:
        raise ConfigError(f"--num-proc {num_proc}: must be >= 1")
    if docs_per_shard < 1:
        raise ConfigError(f"--docs-per-shard {docs_per_shard}: must be >= 1")
    check_policy(errors)
    parse_source(input, "--input")  # one-line errors before anything is written
    if val_input is not None:
        parse_source(val_input, "--val-input")
    info = tokenizer_info(tokenizer_dir)
    dtype = token_dtype(info.vocab_size)
    out = Path(out)
    inputs = {"input": input, "val_input": val_input}
    plan = {"inputs": inputs, "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
            "tokenizer": info.to_json(), "dtype": dtype.name, "errors": errors}
    replace = _check_out(out, plan, restart)
    text_errors = None if errors == "strict" else TextErrors(errors)
    opened = {}
    with _datasets_progress(progress):  # opened and checked before anything is written
        for name, value in inputs.items():
            if value is not None:
                opened[name] = _open_input(value, "--" + name.replace("_", "-"), docs_per_shard, text_errors)
    if val_fraction > 0 and val_input is None:
        _check_holds_out(_texts(opened["input"][0], docs_per_shard), val_fraction)
    if replace:
        _remove_output(out)

    created = not out.exists()
    progress_dir = out / PROGRESS_DIR
    if not _holds_units(out) and progress_dir.exists():
        shutil.rmtree(progress_dir)  # an earlier call's plan and nothing else: replaced
    progress_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(progress_dir / PLAN_FILE, plan)
    (out / META_FILE).unlink(missing_ok=True)  # not complete until every unit is checked against its texts
    try:
        records, encoded, tokens, seconds = _encode_inputs(opened, out, dtype, tokenizer_dir, info, val_fraction,
                                                           num_proc, docs_per_shard, progress)
    except BaseException:
        if not _holds_units(out):  # nothing a rerun could reuse: leave nothing behind
            shutil.rmtree(out if created else progress_dir, ignore_errors=True)
        raise
    meta = _meta(plan, records)
    if text_errors is not None:
        meta["text_errors"] = text_errors.as_dict()
    if not any(s["tokens"] for s in meta["splits"].values()):
        if not _holds_units(out):
            shutil.rmtree(out if created else progress_dir, ignore_errors=True)
        raise ConfigError(f"--input: {input} holds no documents")
    write_json_atomic(out / META_FILE, meta)
    return Result(meta, encoded, len(records) - encoded, tokens, seconds, num_proc, text_errors)


def _encode_inputs(opened: dict[str, tuple[Any, int | None]], out: Path, dtype, tokenizer_dir, info,
                   val_fraction: float, num_proc: int, docs_per_shard: int, progress: bool):
    """Every unit still to do of every opened input: (records, units encoded, tokens, seconds)."""
    from tqdm import tqdm

    records = _load_records(out, dtype)
    start = time.perf_counter()
    encoded = tokens = 0
    for name, (ds, n_units) in opened.items():
        tag = INPUT_TAGS[name]
        done = {r["unit"]: r.get("texts_sha256") for r in records.values() if r["tag"] == tag}
        bar = tqdm(total=n_units, unit="shard", desc=f"pretokenize {name}", disable=not progress)
        seen: list[int] = []
        units = _units(ds, n_units, docs_per_shard, done, "--" + name.replace("_", "-"), seen)
        for record in _run_units(units, tag, name == "val_input", tokenizer_dir, info, out, val_fraction, num_proc):
            write_json_atomic(out / PROGRESS_DIR / f"{tag}{record['unit']:05d}.json", record)
            records[(tag, record["unit"])] = record
            encoded += 1
            tokens += sum(s["tokens"] for s in record["splits"].values())
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - start):,.0f}")
        bar.close()
        for key in [k for k in records if k[0] == tag and k[1] >= seen[0]]:  # an input that shrank
            _drop_unit(out, records.pop(key))
    return records, encoded, tokens, time.perf_counter() - start


def _drop_unit(out: Path, record: dict[str, Any]) -> None:
    """A unit the input no longer has: its shards and its progress record."""
    for shard in record["splits"].values():
        (out / shard["file"]).unlink(missing_ok=True)
        (out / shard["file"]).with_suffix(".idx.npy").unlink(missing_ok=True)
    (out / PROGRESS_DIR / f"{record['tag']}{record['unit']:05d}.json").unlink(missing_ok=True)


def _run_units(units, tag: str, heldout: bool, tokenizer_dir, info, out: Path, val_fraction: float,
               num_proc: int) -> Iterator[dict[str, Any]]:
    init_args = (str(Path(tokenizer_dir) / TOKENIZER_FILE), info, str(out), val_fraction)
    if num_proc == 1:
        _init_worker(*init_args)
        for unit, texts, digest in units:
            yield _encode_unit(tag, unit, texts, heldout, digest)
        return
    # fork: workers start in milliseconds (no re-import) and the parent never ran torch ops.
    # At most 2 units per worker in flight, so memory stays bounded on any input size.
    with multiprocessing.get_context("fork").Pool(num_proc, _init_worker, init_args) as pool:
        pending: deque = deque()
        for unit, texts, digest in units:
            pending.append(pool.apply_async(_encode_unit, (tag, unit, texts, heldout, digest)))
            while len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _load_records(out: Path, dtype: np.dtype) -> dict[tuple[str, int], dict[str, Any]]:
    """Progress records of finished units whose files are intact (others are redone)."""
    records = {}
    for path in sorted((out / PROGRESS_DIR).glob("*.json")):
        if path.name == PLAN_FILE:
            continue
        try:
            record = read_json(path, "", keys=("tag", "unit", "splits"))
        except ConfigError:  # a record cut short (a crash while it was written): its unit is redone
            path.unlink()
            continue
        if _unit_is_intact(out, record, dtype):
            records[(record["tag"], record["unit"])] = record
        else:
            path.unlink()
    return records


def _meta(plan: dict[str, Any], records: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for split in SPLITS:
        shards = [r["splits"][split] for _, r in sorted(records.items()) if split in r["splits"]]
        # --input's units first, then --val-input's (tag "" sorts before "heldout-")
        shards.sort(key=lambda s: (s["file"].split("/")[1].startswith("heldout-"), s["file"]))
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "docs": sum(s["docs"] for s in shards), "shards": shards}
    units = {name: sorted(u for (t, u) in records if t == tag) for name, tag in INPUT_TAGS.items()
             if plan["inputs"][name] is not None}
    return {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": plan["tokenizer"],
            "dtype": plan["dtype"], "inputs": plan["inputs"], "val_fraction": plan["val_fraction"],
            "docs_per_shard": plan["docs_per_shard"], "units": units, "splits": splits}
