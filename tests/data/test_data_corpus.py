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


def test_the_code_source_is_the_stdlib_split_like_the_docs(builtin_corpus):
    """The second source: every stdlib module's own source text, titled by its module name,
    so a module lands in the same split in both sources (its docstrings are held out in
    both or in neither), at least 10M tokens' worth of text, and built deterministically."""
    from gamma_titan.data.builtin_corpus import CODE_SKIPPED_FOLDERS, ensure_builtin_corpus

    code = ensure_builtin_corpus(source="code")
    meta = json.loads((code / "meta.json").read_text())
    assert meta["name"].startswith("pycode-") and meta["format_version"] == 1
    assert meta["splits"]["train"]["characters"] > 20_000_000  # ≈ 1.77 characters per token at vocab 512
    split_of = {}
    for split in ("train", "validation"):
        for text in read_texts(code / f"{split}.jsonl"):
            title = text.split("\n", 1)[0].removeprefix("# ")
            assert text.startswith(f"# {title}\n") and "\t" not in text and "\n\n\n" not in text
            split_of[title] = split
            assert is_validation(title) == (split == "validation")
    assert {"json", "json.decoder", "email.message", "test.test_json"} <= set(split_of)
    assert not any(set(t.split(".")) & CODE_SKIPPED_FOLDERS for t in split_of)  # no topics data, no packages
    docs = {t: split for split in ("train", "validation")
            for t in _titles(builtin_corpus / f"{split}.jsonl") if not t.startswith("topic: ")}
    shared = set(docs) & set(split_of)
    assert len(shared) > 300 and all(docs[t] == split_of[t] for t in shared)
    json_code = next(t for t in read_texts(code / f"{split_of['json']}.jsonl") if t.startswith("# json\n"))
    json_doc = next(t for t in read_texts(builtin_corpus / f"{docs['json']}.jsonl") if t.startswith("json\n"))
    assert json_doc.split("\n", 2)[1] in json_code  # the module docstring's first line is in its code
