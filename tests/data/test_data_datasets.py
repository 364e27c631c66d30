"""Our entries in TorchTitan's dataset registry, used through TorchTitan's own classes."""

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
from datasets import Dataset, DatasetDict
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

from gamma_titan.data.registry import check_dataset, register_datasets
from gamma_titan.data.text_sources import parse_source
from gamma_titan.errors import ConfigError

SEQ_LEN = 32
RECORDS = [{"text": f"Document number {i}. " * (i + 3), "id": i} for i in range(12)]
TEXTS = [r["text"] for r in RECORDS]


@pytest.fixture(autouse=True)
def _registered():
    register_datasets()


@pytest.fixture
def tmp_cache(monkeypatch, tmp_path):
    """Keep the arrow files that `datasets` makes from local files out of the real cache."""
    monkeypatch.setenv("GAMMA_TITAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)


def _check_samples(dataset, tokenizer, count):
    samples = list(itertools.islice(iter(dataset), count))
    assert len(samples) == count
    for inputs, labels in samples:
        assert set(inputs) == {"input"}
        x = inputs["input"]
        assert x.dtype == torch.long and x.shape == (SEQ_LEN,) and labels.shape == (SEQ_LEN,)
        assert torch.equal(x[1:], labels[:-1])  # labels are the inputs shifted by one
        assert int(x.max()) < tokenizer.get_vocab_size()
    return samples


def _texts(name, path):
    """What TorchTitan's loader for `name` yields for `path`, as plain strings."""
    config = DATASETS[name]
    return [config.sample_processor(s) for s in config.loader(path)]


# ---- hf: local files --------------------------------------------------------------------------


def _write(folder, kind, records=RECORDS, name="data"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records))
    elif kind == "parquet":
        pd.DataFrame(records).to_parquet(path)
    elif kind == "txt":
        path.write_text("\n\n".join(r["text"] for r in records) + "\n")
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_hf_local_file(kind, tmp_path, tmp_cache, titan_tokenizer):
    path = str(_write(tmp_path / "in", kind))
    assert _texts("hf", path) == TEXTS
    _check_samples(HuggingFaceTextDataset("hf", path, titan_tokenizer, SEQ_LEN), titan_tokenizer, 3)


def test_hf_txt_file_is_one_record_per_paragraph(tmp_path, tmp_cache, titan_tokenizer):
    path = str(_write(tmp_path / "in", "txt"))
    assert [t.strip() for t in _texts("hf", path)] == [t.strip() for t in TEXTS]
    _check_samples(HuggingFaceTextDataset("hf", path, titan_tokenizer, SEQ_LEN), titan_tokenizer, 3)


def test_hf_folder_of_files(tmp_path, tmp_cache):
    folder = tmp_path / "in"
    _write(folder / "part", "jsonl", RECORDS[6:], name="b")
    _write(folder, "jsonl", RECORDS[:6], name="a")
    (folder / "README.md").write_text("ignored")
    assert _texts("hf", str(folder)) == TEXTS  # files in sorted path order


def test_a_folder_may_mix_file_kinds_each_read_as_its_suffix_says(tmp_path, tmp_cache):
    folder = tmp_path / "in"
    _write(folder, "jsonl", RECORDS[:4], name="a")
    _write(folder, "parquet", RECORDS[4:8], name="b")
    _write(folder / "c", "txt", RECORDS[8:], name="c")
    assert [t.strip() for t in _texts("hf", str(folder))] == [t.strip() for t in TEXTS]  # a.jsonl, b.parquet, c/c.txt


def test_local_sources_are_read_where_they_are(tmp_path, monkeypatch, builtin_tokenizer):
    """Nothing of a local source lands in a cache: the "hf" dataset, pretokenize and
    tokenizer train stream the files themselves (datasets leaves one empty lock file)."""
    from gamma_titan.data.pretokenize import pretokenize
    from gamma_titan.data.text_sources import load_source, parse_source

    monkeypatch.setenv("GAMMA_TITAN_CACHE", str(tmp_path / "ours"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "theirs"))
    folder = tmp_path / "in"
    _write(folder, "jsonl", RECORDS[:6], name="a")
    _write(folder, "parquet", RECORDS[6:], name="b")
    assert _texts("hf", str(folder)) == TEXTS
    source = parse_source(str(folder))
    assert [r["text"] for r in load_source(source, str(folder))] == TEXTS
    pretokenize(str(folder), builtin_tokenizer, tmp_path / "shards", progress=False)
    written = [p for root in ("ours", "theirs") for p in (tmp_path / root).rglob("*") if p.is_file()]
    assert all(p.stat().st_size == 0 and p.suffix == ".lock" for p in written), written


def test_hf_save_to_disk_folders(tmp_path, tmp_cache):
    Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "single"))
    assert _texts("hf", str(tmp_path / "single")) == TEXTS

    DatasetDict(
        train=Dataset.from_list(RECORDS[:8]), validation=Dataset.from_list(RECORDS[8:])
    ).save_to_disk(str(tmp_path / "dict"))
    assert _texts("hf", str(tmp_path / "dict")) == TEXTS[:8]
    assert _texts("hf", f"{tmp_path / 'dict'}:validation") == TEXTS[8:]
    with pytest.raises(ConfigError, match="no split 'test'"):
        _texts("hf", f"{tmp_path / 'dict'}:test")


def test_hf_missing_text_column(tmp_path, tmp_cache):
    path = _write(tmp_path, "jsonl", [{"body": "x"}])
    with pytest.raises(ConfigError, match="data.jsonl: line 1: no 'text' field \\(fields: body\\)"):
        _texts("hf", str(path))


def test_hf_local_file_offline(tmp_path):
    """With HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set, local data still loads."""
    path = _write(tmp_path, "jsonl")
    script = textwrap.dedent(f"""
        from gamma_titan.data.registry import register_datasets
        from torchtitan.hf_datasets.text_datasets import DATASETS
        register_datasets()
        print(len(list(DATASETS["hf"].loader({str(path)!r}))))
    """)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               GAMMA_TITAN_CACHE=str(tmp_path / "cache"))
    env.pop("HF_DATASETS_CACHE", None)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(len(RECORDS))


# ---- hub ids (parsed only: no network here) ---------------------------------------------------


@pytest.mark.parametrize(
    "value, repo, config, split",
    [
        ("allenai/c4", "allenai/c4", None, "train"),
        ("allenai/c4/en", "allenai/c4", "en", "train"),
        ("allenai/c4/en:validation", "allenai/c4", "en", "validation"),
        ("HuggingFaceFW/fineweb-edu:train", "HuggingFaceFW/fineweb-edu", None, "train"),
    ],
)
def test_hub_ids(value, repo, config, split, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder shadows the owner name
    source = parse_source(value)
    assert source.kind == "hub"
    assert (source.location, source.config, source.split) == (repo, config, split)


# ---- pre-flight checks ------------------------------------------------------------------------


def _error(name, path, key="training"):
    with pytest.raises(ConfigError) as err:
        check_dataset(name, path, key)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_check_accepts_good_choices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = _write(tmp_path, "jsonl")
    for name, path in [
        ("builtin", None), ("BUILTIN_validation", ""), ("hf", str(data)), ("hf", "owner/name"),
        ("hf", "owner/name/config:test"), ("c4", None), ("c4_validation", None),
    ]:
        check_dataset(name, path, "training")


def test_check_unknown_name_lists_allowed():
    message = _error("wikipedia", None)
    assert message.startswith("training.dataset: unknown dataset 'wikipedia'; allowed: ")
    for name in ("builtin", "builtin_validation", "hf", "c4", "c4_test", "c4_validation"):
        assert name in message


def test_check_bad_paths_name_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "missing.jsonl")
    assert _error("hf", missing, "validation") == (
        f"validation.dataset_path: '{missing}' does not exist; use a local "
        ".jsonl/.json/.parquet/.txt file or folder, a save_to_disk folder, "
        "or a hub id owner/name[/config][:split]"
    )
    assert _error("hf", None).startswith("training.dataset_path: the 'hf' dataset needs a path")
    assert "neither an existing local path nor a hub dataset id" in _error("hf", "not a dataset!")
    assert "neither" in _error("hf", "a/b/c/d")
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    assert "unsupported file type" in _error("hf", str(csv))
    (tmp_path / "empty").mkdir()
    assert "has no .jsonl/.json/.parquet/.txt files" in _error("hf", str(tmp_path / "empty"))
    # TorchTitan's own default dataset reads a relative folder this repo does not have.
    expected = "training.dataset_path: dataset 'c4_test' reads 'tests/assets/c4_test'"
    assert expected in _error("c4_test", None)


def test_register_is_idempotent():
    register_datasets()
    before = dict(DATASETS)
    register_datasets()
    assert DATASETS == before
    ours_and_titans = {"hf", "c4", "c4_test", "c4_validation"}
    assert ours_and_titans <= set(DATASETS)
