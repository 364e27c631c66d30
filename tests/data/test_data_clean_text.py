"""Text that is not clean (gamma_titan/data/clean_text.py), through `pretokenize`, `tokenizer
train` and the "hf" dataset: refused in one line naming the file and the line (or row) and
leaving nothing behind, or with --errors replace/skip cleaned and counted; and a failed
`pretokenize` never blocks its retry."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gamma_titan.data import pretokenize as pretokenize_module
from gamma_titan.data.clean_text import TextErrors, clean_texts, scan_files
from gamma_titan.data.pretokenize import pretokenize
from gamma_titan.data.registry import check_hf_source
from gamma_titan.data.text_sources import load_source, parse_source
from gamma_titan.data.tokenizer import train_tokenizer_from
from gamma_titan.errors import ConfigError

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
GOOD = ["The first document is plain.", "A second one, also fine.", "Third: ünïcödé is fine too."]


def dirty_files(root):
    """{name: (path, what strict mode must say)}: every way a record can be unclean."""
    files = {}
    latin = root / "latin1.txt"
    latin.write_bytes("First paragraph.\n\nCaf\xe9 au lait, na\xefve.\nsecond line\n\nLast.\n".encode("latin-1"))
    files["latin1"] = (latin, "latin1.txt: line 3: 2 byte(s) not UTF-8, the first at byte offset 21 of the file")
    broken = root / "broken.jsonl"
    broken.write_bytes(b'{"text": "fine"}\n{"text": "bad \xff\xfe bytes"}\n')
    files["broken_jsonl"] = (broken, "broken.jsonl: line 2: 2 byte(s) not UTF-8, the first at byte offset 31 of the file")
    for name, line in [("null", '{"text": null}'), ("number", '{"text": 5}'), ("malformed", '{"text": "no end'),
                       ("missing", '{"body": "x"}')]:
        path = root / f"{name}.jsonl"
        path.write_text('{"text": "ok"}\n' + line + "\n")
        files[name] = (path, {"null": "null.jsonl: line 2: 'text' is null",
                              "number": "number.jsonl: line 2: 'text' is not a string (int 5)",
                              "malformed": "malformed.jsonl: line 2: not JSON (Invalid control character at column 17)",
                              "missing": "missing.jsonl: line 2: no 'text' field (fields: body)"}[name])
    parquet = root / "broken.parquet"
    pq.write_table(pa.table({"text": pa.array([b"good row", b"bad \xff row"], pa.binary()).view(pa.string())}), parquet)
    files["broken_parquet"] = (parquet, "broken.parquet: row 1: 1 byte(s) not UTF-8, the first at byte offset 4 of its text")
    null_parquet = root / "null.parquet"
    pq.write_table(pa.table({"text": pa.array(["x", None])}), null_parquet)
    files["null_parquet"] = (null_parquet, "null.parquet: row 1: 'text' is null")
    return files


@pytest.fixture(scope="module")
def dirty(tmp_path_factory):
    return dirty_files(tmp_path_factory.mktemp("dirty"))


CASES = ["latin1", "broken_jsonl", "null", "number", "malformed", "missing", "broken_parquet", "null_parquet"]


@pytest.mark.parametrize("case", CASES)
def test_strict_refuses_in_one_line_naming_the_file_and_line_and_writes_nothing(case, dirty, tmp_path,
                                                                                  builtin_tokenizer):
    path, expected = dirty[case]
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        pretokenize(str(path), builtin_tokenizer, out, progress=False)
    message = str(err.value)
    assert message.startswith(f"--input: {path.parent}/") and expected in message and "\n" not in message
    assert "--errors replace|skip" in message
    assert not out.exists()
    with pytest.raises(ConfigError) as tok_err:  # tokenizer train: the same line
        train_tokenizer_from(str(path), 300, tmp_path / "tok")
    assert expected in str(tok_err.value) and not (tmp_path / "tok").exists()
    with pytest.raises(ConfigError) as hf_err:  # the "hf" dataset's pre-flight: the same, its key
        check_hf_source(str(path), "training.dataset_path")
    assert str(hf_err.value).startswith("training.dataset_path: ") and expected in str(hf_err.value)
    assert "gamma-titan pretokenize --errors replace|skip" in str(hf_err.value)


def test_a_save_to_disk_folder_with_a_null_text_is_refused_by_record(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": ["a", None, "c"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match=r"^training.dataset_path: '.*saved': record 1: 'text' is null"):
        check_hf_source(str(tmp_path / "saved"), "training.dataset_path")
    Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(tmp_path / "numbers"))
    with pytest.raises(ConfigError, match="the 'text' column holds int64, not strings"):
        check_hf_source(str(tmp_path / "numbers"), "training.dataset_path")


def test_replace_gives_the_documents_with_one_replacement_character_per_byte(dirty, tmp_path, builtin_tokenizer):
    """Against a reference: the same file written clean with U+FFFD where the bytes were,
    pretokenized strictly, gives the same shards."""
    path, _ = dirty["broken_jsonl"]
    result = pretokenize(str(path), builtin_tokenizer, tmp_path / "replaced", errors="replace", progress=False)
    assert result.meta["text_errors"] == {"policy": "replace", "docs_replaced": 1, "bytes_replaced": 2,
                                          "docs_skipped": {}, "bytes_skipped": 0}
    assert "--errors replace: 1 docs with 2 undecodable bytes replaced; 0 docs skipped" in result.summary()
    reference = tmp_path / "reference.jsonl"
    reference.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "bad \ufffd\ufffd bytes"}) + "\n")
    strict = pretokenize(str(reference), builtin_tokenizer, tmp_path / "reference", progress=False)
    assert [s["sha256"] for s in result.meta["splits"]["train"]["shards"]] == \
        [s["sha256"] for s in strict.meta["splits"]["train"]["shards"]]
    assert json.loads((tmp_path / "replaced" / "meta.json").read_text())["text_errors"]["bytes_replaced"] == 2


@pytest.mark.parametrize("case, policy, docs, skipped", [
    ("latin1", "skip", 2, {"undecodable bytes": 1}),
    ("latin1", "replace", 3, {}),
    ("broken_parquet", "skip", 1, {"undecodable bytes": 1}),
    ("null", "replace", 1, {"text is null": 1}),
    ("number", "skip", 1, {"text is not a string": 1}),
    ("malformed", "replace", 1, {"not JSON": 1}),
    ("missing", "skip", 1, {"no text field": 1}),
])
def test_replace_and_skip_count_what_they_did(case, policy, docs, skipped, dirty, tmp_path, builtin_tokenizer):
    path, _ = dirty[case]
    result = pretokenize(str(path), builtin_tokenizer, tmp_path / "out", errors=policy, progress=False)
    assert result.meta["splits"]["train"]["docs"] == docs
    assert result.meta["text_errors"]["docs_skipped"] == skipped
    errors = TextErrors(policy)  # tokenizer train reads the same documents
    assert len(list(clean_texts(parse_source(str(path)).files, errors))) == docs
    assert errors.as_dict() == result.meta["text_errors"]


def test_a_hub_or_saved_source_is_not_cleaned(tmp_path, builtin_tokenizer):
    from datasets import Dataset

    Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match="--errors skip reads local .txt/.jsonl/.json/.parquet files"):
        pretokenize(str(tmp_path / "saved"), builtin_tokenizer, tmp_path / "out", errors="skip", progress=False)
    assert not (tmp_path / "out").exists()


def test_text_paragraphs_are_the_datasets_builders(tmp_path):
    """Our reader splits .txt as `datasets`' text builder does (sample_by="paragraph"): the
    records every command streams are the ones that builder would give."""
    from datasets import load_dataset

    path = tmp_path / "t.txt"
    path.write_bytes(b"a b\nc\n\n\nd e\r\n\r\nf\n\n\n\n\ng\ntail\n")
    ours = [r.text for r in scan_files([str(path)])]
    theirs = load_dataset("text", data_files=[str(path)], split="train", sample_by="paragraph",
                          cache_dir=str(tmp_path / "arrow"))["text"]
    assert ours == list(theirs) == [t for t in load_source(parse_source(str(path)), str(path))["text"]]
    assert [r.where for r in scan_files([str(path)])] == ["line 1", "line 5", "line 7", "line 12"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_json_and_parquet_records_are_the_datasets_builders(suffix, tmp_path):
    """Our readers give the packaged json / parquet builders' records (text field only, other
    fields, empty texts and unicode included), in order."""
    import pandas as pd
    from datasets import load_dataset

    records = [{"text": "first", "id": 1}, {"text": "", "id": 2}, {"text": "é \u2028 line\nbreak", "id": 3},
               {"text": "last", "id": 4}]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        pd.DataFrame(records).to_parquet(path)
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}[suffix]
    theirs = load_dataset(builder, data_files=[str(path)], split="train", cache_dir=str(tmp_path / "arrow"))["text"]
    ours = [r.text for r in scan_files([str(path)])]
    assert ours == list(theirs) == [r["text"] for r in records]
    assert [t for t in load_source(parse_source(str(path)), str(path))["text"]] == ours


# --- a failed pretokenize never blocks its retry ---------------------------------------------------

def docs(n):
    return [f"Document number {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(30)) for i in range(n)]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def shard_hashes(meta):
    return [(s["file"], s["sha256"]) for split in meta["splits"].values() for s in split["shards"]]


def test_a_failure_in_the_third_unit_keeps_two_and_the_rerun_equals_a_clean_run(tmp_path, builtin_tokenizer,
                                                                                 monkeypatch):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs(50))
    clean = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "clean", docs_per_shard=10, progress=False)
    encode = pretokenize_module._encode_unit

    def failing(tag, unit, texts, heldout, digest):
        if unit == 2:
            raise RuntimeError("worker died")
        return encode(tag, unit, texts, heldout, digest)

    monkeypatch.setattr(pretokenize_module, "_encode_unit", failing)
    with pytest.raises(RuntimeError):
        pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", docs_per_shard=10, progress=False)
    kept = sorted(p.name for p in (tmp_path / "out" / ".progress").glob("0*.json"))
    assert kept == ["00000.json", "00001.json"] and not (tmp_path / "out" / "meta.json").exists()
    monkeypatch.setattr(pretokenize_module, "_encode_unit", encode)
    rerun = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", docs_per_shard=10, progress=False)
    assert (rerun.units_encoded, rerun.units_skipped) == (3, 2)
    assert shard_hashes(rerun.meta) == shard_hashes(clean.meta)


def test_a_failure_before_any_unit_leaves_nothing_and_a_plan_alone_is_replaced(tmp_path, builtin_tokenizer,
                                                                                monkeypatch):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs(20))

    def failing(*args):
        raise RuntimeError("worker died")

    encode = pretokenize_module._encode_unit
    monkeypatch.setattr(pretokenize_module, "_encode_unit", failing)
    with pytest.raises(RuntimeError):
        pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", docs_per_shard=10, progress=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(pretokenize_module, "_encode_unit", encode)
    # a folder an older version left with only its plan (other settings): replaced, not refused
    (tmp_path / "old" / ".progress").mkdir(parents=True)
    (tmp_path / "old" / ".progress" / "plan.json").write_text(json.dumps({"docs_per_shard": 99}))
    result = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "old", docs_per_shard=10, progress=False)
    assert result.units_encoded == 2
    with pytest.raises(ConfigError, match="holds shards written with other settings \\(docs_per_shard differ\\)"):
        pretokenize(str(corpus), builtin_tokenizer, tmp_path / "old", docs_per_shard=5, progress=False)


def test_an_edited_input_redoes_only_the_units_it_changed(tmp_path, builtin_tokenizer):
    texts = docs(30)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", texts)
    pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", docs_per_shard=10, progress=False)
    texts[14] = "An edited document in the second unit."
    write_jsonl(corpus, texts[:25])  # and the last unit shrinks
    rerun = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", docs_per_shard=10, progress=False)
    clean = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "clean", docs_per_shard=10, progress=False)
    assert (rerun.units_encoded, rerun.units_skipped) == (2, 1)
    assert shard_hashes(rerun.meta) == shard_hashes(clean.meta) and rerun.meta["splits"]["train"]["docs"] == 25
    tokens = np.fromfile(tmp_path / "out" / rerun.meta["splits"]["train"]["shards"][1]["file"], dtype=np.uint16)
    assert tokens.size == rerun.meta["splits"]["train"]["shards"][1]["tokens"]


def test_train_refuses_an_unclean_hf_source_before_its_run_folder(dirty, tmp_path):
    path, expected = dirty["null"]
    dump = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gamma_titan.cli", "train", str(REPO / "configs/dense/debug.toml"),
                           "--training.dataset", "hf", "--training.dataset_path", str(path), "--training.steps", "2",
                           "--job.dump_folder", str(dump)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training.dataset_path: ") and expected in last
    assert not dump.exists()


def test_a_fraction_that_holds_out_nothing_is_refused_before_anything_is_written(tmp_path, builtin_tokenizer):
    """30 documents at 1%: none is held out (each is by its text's hash), so the validation
    split would be empty, which training refuses much later. Refused now, naming the least
    fraction that holds one out; that fraction does (the least document's rank, recomputed)."""
    import re

    from gamma_titan.data.pretokenize import held_out_rank

    texts = docs(30)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", texts)
    least = min(held_out_rank(t) for t in texts)
    assert least > 0.01  # the case: no document under 1%
    with pytest.raises(ConfigError) as refused:
        pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", val_fraction=0.01, progress=False)
    text = str(refused.value)
    assert "\n" not in text and text.startswith("--val-fraction 0.01: none of the 30 documents of --input is held out")
    needed = float(re.search(r"use --val-fraction (\S+) or more", text).group(1))
    assert least < needed <= 1.1 * least and not (tmp_path / "out").exists()
    result = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "out", val_fraction=needed, progress=False)
    assert result.meta["splits"]["validation"]["docs"] >= 1
    # with --val-input the input may hold nothing out: the validation split has those
    heldout = write_jsonl(tmp_path / "val.jsonl", docs(3))
    result = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "with_val", val_input=str(heldout),
                         val_fraction=0.01, progress=False)
    assert result.meta["splits"]["validation"]["docs"] == 3


def test_restart_replaces_the_shards_of_other_settings_and_nothing_else(tmp_path, builtin_tokenizer, capsys):
    """Other settings in an existing --out are refused, naming --restart; with it, that
    folder's shards, records and meta.json go (a file of the user's beside them stays) once
    the new input has opened, and the output is what a fresh folder gets."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs(30))
    out = tmp_path / "out"
    pretokenize(str(corpus), builtin_tokenizer, out, docs_per_shard=10, progress=False)
    (out / "NOTES.txt").write_text("mine")
    with pytest.raises(ConfigError, match="add --restart to replace them, or use a new --out folder"):
        pretokenize(str(corpus), builtin_tokenizer, out, docs_per_shard=5, progress=False)
    with pytest.raises(ConfigError, match="does not exist"):  # a bad new input: the old shards stay
        pretokenize(str(tmp_path / "missing.jsonl"), builtin_tokenizer, out, docs_per_shard=5, progress=False,
                    restart=True)
    assert len(list((out / "train").iterdir())) == 2 * 3  # 3 shards and their indexes
    from gamma_titan.cli import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["pretokenize", "--input", str(corpus), "--tokenizer", str(builtin_tokenizer), "--out", str(out),
                  "--docs-per-shard", "5", "--restart", "--quiet"])
    assert done.value.code == 0
    fresh = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "fresh", docs_per_shard=5, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert shard_hashes(meta) == shard_hashes(fresh.meta) and (out / "NOTES.txt").read_text() == "mine"
    assert len(list((out / "train").iterdir())) == 2 * 6


def _ctrl_c(argv: list[str], ready, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `gamma-titan ARGV` in a session of its own, send SIGINT to its whole process group
    (a terminal's Ctrl-C) once `ready()` holds, and return the finished process."""
    # SIGINT back to its default first: a shell's background job (CI's) starts with it ignored,
    # and Python, finding it ignored, never turns it into KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "gamma_titan.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted: " + proc.stderr.read()[-2000:]
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_ctrl_c_in_pretokenize_ends_in_one_line_and_the_rerun_goes_on(tmp_path, builtin_tokenizer):
    """Ctrl-C reaches the parent and its worker processes (one process group): one line, exit
    130, no traceback; the rerun keeps the finished shards and ends as a clean run does."""
    # 600 units of 50 documents: seconds of work left when the second unit is recorded
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs(30000))
    out = tmp_path / "out"
    argv = ["pretokenize", "--input", str(corpus), "--tokenizer", str(builtin_tokenizer), "--out", str(out),
            "--num-proc", "2", "--docs-per-shard", "50", "--quiet"]
    stopped = _ctrl_c(argv, lambda: len(list((out / ".progress").glob("0*.json"))) >= 2)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert lines == ["interrupted: pretokenize stopped by Ctrl-C; the finished shards are kept: rerun the same "
                     "command to go on from them"], stopped.stderr[-3000:]
    rerun = pretokenize(str(corpus), builtin_tokenizer, out, num_proc=2, docs_per_shard=50, progress=False)
    clean = pretokenize(str(corpus), builtin_tokenizer, tmp_path / "clean", docs_per_shard=50, progress=False)
    assert rerun.units_skipped >= 2 and shard_hashes(rerun.meta) == shard_hashes(clean.meta)


def test_ctrl_c_in_tokenizer_train_ends_in_one_line_and_leaves_a_retry_open(tmp_path):
    # distinct words enough for seconds of merges at this vocabulary
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [f"{t} " + " ".join(f"x{i * 31 + j}y" for j in range(40))
                                                     for i, t in enumerate(docs(40000))])
    out = tmp_path / "tok"
    argv = ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "16384", "--out", str(out)]
    stopped = _ctrl_c(argv, lambda: out.is_dir())  # training has begun (it makes the folder first)
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == ("interrupted: tokenizer stopped by Ctrl-C; no tokenizer was "
                                                        "written: rerun the command")
    assert not any(out.iterdir())  # an empty folder: the rerun may use it
