"""`gamma-titan pretokenize`: text -> token shards, in several processes, resumable.

The input is read in work units of `docs_per_shard` documents. Each unit is tokenized by a
worker process and written as one shard per split (its held-out documents, chosen by a hash
of their text, go to the validation split), then recorded in `.progress/`. A rerun skips
every recorded unit whose files are intact, so an interrupted run resumes where it stopped
and a finished one does nothing; meta.json, written last, marks the folder complete. The
unit layout does not depend on the number of processes, so neither does the output.

Tokenization happens in the workers, one thread each (TOKENIZERS_PARALLELISM=false):
`num_proc` is the parallelism, and the throughput per process is what it reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gamma_titan.data.cache import write_json_atomic
from gamma_titan.data.shards import FORMAT, FORMAT_VERSION, META_FILE, SPLITS, TokenizerInfo, token_dtype, tokenizer_info
from gamma_titan.data.text_sources import TEXT_FIELD, load_source, parse_source
from gamma_titan.errors import ConfigError
from gamma_titan.files import TOKENIZER_FILE

PROGRESS_DIR = ".progress"
PLAN_FILE = "plan.json"
DEFAULT_DOCS_PER_SHARD = 20_000

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

    def summary(self) -> str:
        splits = ", ".join(f"{name} {s['docs']} docs / {s['tokens']} tokens"
                           for name, s in self.meta["splits"].items())
        line = f"{splits}; {self.units_encoded} shards written, {self.units_skipped} already done"
        if self.units_encoded:
            rate = self.tokens_encoded / self.seconds
            line += (f"; {self.tokens_encoded} tokens in {self.seconds:.1f} s = {rate:,.0f} tokens/s "
                     f"({rate / self.num_proc:,.0f} per process, {self.num_proc} processes)")
        return line


def is_validation(text: str, fraction: float) -> bool:
    """Held-out by content: the same text always lands in the same split."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


# --------------------------------------------------------------------------- worker side

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, info: TokenizerInfo, out: str, val_fraction: float) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_file(tokenizer_file), info=info, out=Path(out),
                   dtype=token_dtype(info.vocab_size), val_fraction=val_fraction)


def _encode_unit(tag: str, unit: int, texts: list[str], heldout: bool) -> dict[str, Any]:
    """Tokenize one unit and write its shards; returns its progress record."""
    w = _worker
    encodings = w["tokenizer"].encode_batch(texts, add_special_tokens=False)
    docs: dict[str, list[list[int]]] = {split: [] for split in SPLITS}
    for text, enc in zip(texts, encodings):
        split = "validation" if heldout or is_validation(text, w["val_fraction"]) else "train"
        docs[split].append(enc.ids)
    record: dict[str, Any] = {"tag": tag, "unit": unit, "docs_in": len(texts), "splits": {}}
    for split, ids in docs.items():
        if ids:
            record["splits"][split] = _write_shard(w["out"], f"{split}/{tag}{unit:05d}", ids,
                                                   w["info"], w["dtype"])
    return record


def _write_shard(out: Path, stem: str, docs: list[list[int]], info: TokenizerInfo, dtype) -> dict[str, Any]:
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


def _check_out(out: Path, plan: dict[str, Any]) -> None:
    """`out` must be empty, or a folder this same plan started (resume) or finished."""
    plan_file = out / PROGRESS_DIR / PLAN_FILE
    if plan_file.is_file():
        previous = json.loads(plan_file.read_text(encoding="utf-8"))
        changed = sorted(k for k in plan.keys() | previous.keys() if plan.get(k) != previous.get(k))
        if changed:
            raise ConfigError(f"--out: {out} holds shards written with other settings "
                              f"({', '.join(changed)} differ); use a new --out folder")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} exists and is not an empty folder or a pretokenize output; "
                          "use a new --out folder")


def _open_input(source_value: str, key: str, docs_per_shard: int):
    """(dataset, number of units or None for a stream) of a text source, opened once."""
    from datasets import Dataset

    ds = load_source(parse_source(source_value, key), source_value)
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


def _units(ds, n_units: int | None, docs_per_shard: int, done: set[int]) -> Iterator[tuple[int, list[str]]]:
    """(unit, texts) of every unit not in `done`."""
    if n_units is not None:  # random access: read only the units still to do
        for unit in range(n_units):
            if unit not in done:
                yield unit, ds[unit * docs_per_shard : (unit + 1) * docs_per_shard][TEXT_FIELD]
        return
    for unit, batch in enumerate(ds.iter(batch_size=docs_per_shard)):  # a stream: read it all
        if unit not in done:
            yield unit, batch[TEXT_FIELD]


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
) -> Result:
    """Tokenize `input` (and `val_input`) into shards in `out`; see the module docstring."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if num_proc < 1:
        raise ConfigError(f"--num-proc {num_proc}: must be >= 1")
    if docs_per_shard < 1:
        raise ConfigError(f"--docs-per-shard {docs_per_shard}: must be >= 1")
    parse_source(input, "--input")  # one-line errors before anything is written
    if val_input is not None:
        parse_source(val_input, "--val-input")
    info = tokenizer_info(tokenizer_dir)
    dtype = token_dtype(info.vocab_size)
    out = Path(out)
    inputs = {"input": input, "val_input": val_input}
    plan = {"inputs": inputs, "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
            "tokenizer": info.to_json(), "dtype": dtype.name}
    _check_out(out, plan)
    if (out / META_FILE).is_file() and _complete(out, dtype):
        meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
        n = sum(len(m) for m in meta["units"].values())
        return Result(meta, 0, n, 0, 0.0, num_proc)

    progress_dir = out / PROGRESS_DIR
    progress_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(progress_dir / PLAN_FILE, plan)
    (out / META_FILE).unlink(missing_ok=True)  # not complete any more (a unit is redone)

    records = _load_records(out, dtype)
    start = time.perf_counter()
    encoded = tokens = 0
    from tqdm import tqdm

    for name, value in inputs.items():
        if value is None:
            continue
        tag = INPUT_TAGS[name]
        done = {r["unit"] for r in records.values() if r["tag"] == tag}
        key = "--" + name.replace("_", "-")
        with _datasets_progress(progress):
            ds, n_units = _open_input(value, key, docs_per_shard)
        bar = tqdm(total=n_units, initial=len(done), unit="shard", desc=f"pretokenize {name}",
                   disable=not progress)
        for record in _run_units(_units(ds, n_units, docs_per_shard, done), tag, name == "val_input",
                                 tokenizer_dir, info, out, val_fraction, num_proc):
            write_json_atomic(progress_dir / f"{tag}{record['unit']:05d}.json", record)
            records[(tag, record["unit"])] = record
            encoded += 1
            tokens += sum(s["tokens"] for s in record["splits"].values())
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - start):,.0f}")
        bar.close()

    meta = _meta(plan, records)
    if not any(s["tokens"] for s in meta["splits"].values()):
        raise ConfigError(f"--input: {input} holds no documents")
    write_json_atomic(out / META_FILE, meta)
    return Result(meta, encoded, len(records) - encoded, tokens, time.perf_counter() - start, num_proc)


def _run_units(units, tag: str, heldout: bool, tokenizer_dir, info, out: Path, val_fraction: float,
               num_proc: int) -> Iterator[dict[str, Any]]:
    init_args = (str(Path(tokenizer_dir) / TOKENIZER_FILE), info, str(out), val_fraction)
    if num_proc == 1:
        _init_worker(*init_args)
        for unit, texts in units:
            yield _encode_unit(tag, unit, texts, heldout)
        return
    # fork: workers start in milliseconds (no re-import) and the parent never ran torch ops.
    # At most 2 units per worker in flight, so memory stays bounded on any input size.
    with multiprocessing.get_context("fork").Pool(num_proc, _init_worker, init_args) as pool:
        pending: deque = deque()
        for unit, texts in units:
            pending.append(pool.apply_async(_encode_unit, (tag, unit, texts, heldout)))
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
        record = json.loads(path.read_text(encoding="utf-8"))
        if _unit_is_intact(out, record, dtype):
            records[(record["tag"], record["unit"])] = record
        else:
            path.unlink()
    return records


def _complete(out: Path, dtype: np.dtype) -> bool:
    meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    records = _load_records(out, dtype)
    return len(records) == sum(len(m) for m in meta["units"].values())


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
