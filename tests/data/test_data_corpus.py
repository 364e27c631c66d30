"""The built-in corpus generated from CPython's documentation."""

import json

from gamma_titan.data.builtin_corpus import (
    MIN_DOC_CHARS,
    SKIPPED_NAMES,
    build_builtin_corpus,
    is_validation,
    read_texts,
)

FILES = ("train.jsonl", "validation.jsonl", "meta.json")


def _titles(path):
    # Each document starts with its title (qualified module name or "topic: <name>").
    return [text.split("\n", 1)[0] for text in read_texts(path)]


def test_two_builds_are_byte_identical(builtin_corpus, tmp_path):
    build_builtin_corpus(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (builtin_corpus / name).read_bytes(), name


def test_splits_are_disjoint_and_chosen_by_title(builtin_corpus):
    train = _titles(builtin_corpus / "train.jsonl")
    validation = _titles(builtin_corpus / "validation.jsonl")
    assert set(train).isdisjoint(validation)
    assert len(set(train)) == len(train) and len(set(validation)) == len(validation)
    assert not any(is_validation(t) for t in train)
    assert all(is_validation(t) for t in validation)
    assert train == sorted(train) and validation == sorted(validation)


def test_size_and_content(builtin_corpus):
    meta = json.loads((builtin_corpus / "meta.json").read_text())
    texts = {split: list(read_texts(builtin_corpus / f"{split}.jsonl")) for split in meta["splits"]}
    for split, counts in meta["splits"].items():
        assert counts["documents"] == len(texts[split])
        assert counts["characters"] == sum(len(t) for t in texts[split])
    assert meta["splits"]["train"]["documents"] > 300
    assert meta["splits"]["train"]["characters"] > 1_000_000
    assert meta["splits"]["validation"]["documents"] >= 3

    everything = texts["train"] + texts["validation"]
    assert all(len(t) >= MIN_DOC_CHARS for t in everything)
    assert all(t == t.strip() and "\n\n\n" not in t and "\t" not in t for t in everything)
    titles = [t.split("\n", 1)[0] for t in everything]
    assert "json" in titles and "topic: assert" in titles
    assert not any(set(title.split(".")) & SKIPPED_NAMES for title in titles)
