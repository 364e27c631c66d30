"""Byte-level BPE training, TorchTitan compatibility and `model.hf_assets_path` resolution."""

import json
import random

import pytest
from tokenizers import Tokenizer
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from gamma_titan.data.builtin_corpus import read_texts
from gamma_titan.data.tokenizer import (
    ensure_builtin_tokenizer,
    resolve_tokenizer_path,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
    train_tokenizer_from,
)
from gamma_titan.errors import ConfigError

SAMPLES = [
    "",
    " leading space and trailing space ",
    "Hello, world! Ünïcödé: naïve café, Straße, Ελληνικά, русский,",
    "日本語, 한국어, עברית, العربية",
    "emoji 🙂👍🏽 and combining e\u0301 and zero-width\u200bjoiner",
    "def f(x):\n\treturn {'a': [x ** 2, None]}  # comment\r\n\n\n    indented\n",
    "\x00\x01 control \x7f chars \ufeff bom \U0010ffff",
]


def _random_text(rng: random.Random, length: int) -> str:
    # Mix ASCII, Latin-1, BMP and astral code points; skip surrogates (not valid text).
    ranges = [
        (0x20, 0x7E), (0x00, 0x1F), (0xA0, 0xFF), (0x100, 0xD7FF), (0xE000, 0xFFFD),
        (0x10000, 0x10FFFF),
    ]
    out = []
    for _ in range(length):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def tiny_tokenizer(builtin_corpus, tmp_path_factory):
    texts = list(read_texts(builtin_corpus / "train.jsonl"))[:40]
    return train_bpe_tokenizer(texts, 300, tmp_path_factory.mktemp("tok300"))


def test_round_trip_is_exact(tiny_tokenizer, titan_tokenizer):
    rng = random.Random(0)
    samples = SAMPLES + [_random_text(rng, n) for n in (1, 7, 50, 400)]
    for tok in (HuggingFaceTokenizer(str(tiny_tokenizer)), titan_tokenizer):
        for text in samples:
            assert tok.decode(tok.encode(text)) == text
            # BOS/EOS are special tokens, which decode() drops by default.
            assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


def test_torchtitan_infers_bos_eos(tiny_tokenizer, builtin_tokenizer):
    for path, size in ((tiny_tokenizer, 300), (builtin_tokenizer, 4096)):
        tok = HuggingFaceTokenizer(str(path))
        assert (tok.bos_id, tok.eos_id) == (0, 1)
        assert tok.token_to_id("<|pad|>") == 2
        assert tok.get_vocab_size() == size == tokenizer_vocab_size(path)
        plain = tok.encode("some text")
        assert 0 not in plain and 1 not in plain  # nothing added unless asked
        assert tok.encode("some text", add_bos=True, add_eos=True) == [0, *plain, 1]


def test_tokenizer_config(builtin_tokenizer):
    config = json.loads((builtin_tokenizer / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>",
    )
    assert config["add_bos_token"] is False and config["add_eos_token"] is False


def test_vocab_json_and_merges_folder(tiny_tokenizer, tmp_path):
    # The other folder layout TorchTitan accepts: vocab.json + merges.txt (+ config).
    Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json")).model.save(str(tmp_path))
    config = (tiny_tokenizer / "tokenizer_config.json").read_bytes()
    (tmp_path / "tokenizer_config.json").write_bytes(config)
    assert resolve_tokenizer_path(str(tmp_path)) == tmp_path.resolve()
    titan_size = HuggingFaceTokenizer(str(tmp_path)).get_vocab_size()
    assert tokenizer_vocab_size(tmp_path) == titan_size == 300


def test_transformers_can_load(tiny_tokenizer):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_too_small_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 259"):
        train_bpe_tokenizer(["abc"], 100, tmp_path)


def test_builtin_vocab_too_small_is_a_config_error():
    with pytest.raises(ConfigError, match="tokenizer vocab size: 100 is too small"):
        ensure_builtin_tokenizer(100)


def test_resolve_builtin(builtin_tokenizer):
    assert resolve_tokenizer_path("builtin") == builtin_tokenizer
    assert resolve_tokenizer_path("builtin:4096") == builtin_tokenizer


@pytest.mark.parametrize("value", ["builtin:abc", "builtin:10", "builtin:"])
def test_resolve_bad_builtin_size(value):
    with pytest.raises(ConfigError) as err:
        resolve_tokenizer_path(value)
    message = str(err.value)
    assert "\n" not in message and "model.hf_assets_path" in message and value in message


def test_resolve_rejects_non_tokenizer_folders(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_tokenizer_path(str(tmp_path))
    assert str(err.value) == (
        f"model.hf_assets_path: '{tmp_path}' is not a tokenizer folder (no tokenizer.json); "
        'use "builtin" or a local folder with tokenizer.json'
    )
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="model.hf_assets_path: .*nope' does not exist"):
        resolve_tokenizer_path(str(missing))


def _corpus(root, seed=0):
    """Two sources: `web` (a .jsonl and a .txt: kinds may mix in a folder) and `code`."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    (root / "web").mkdir(parents=True)
    (root / "code").mkdir()
    with open(root / "web" / "a.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))}) + "\n")
    (root / "web" / "b.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(100)))
    with open(root / "code" / "c.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n")
    return root


@pytest.mark.parametrize("weights", [{"web": 3, "code": 1}, {"web": 1, "code": 4}])
def test_a_tokenizer_trains_on_a_weighted_mix_and_records_it(tmp_path, weights):
    """Each source's share of the bytes is its weight's, to within one of its documents (the
    next text comes from the source furthest below its share), the mix ends when the first
    source runs out, and trained_on.json says so; the counts are the sources' own texts."""
    from gamma_titan.data.clean_text import scan_files
    from gamma_titan.data.text_sources import parse_source
    from gamma_titan.data.tokenizer import TRAINED_ON_FILE

    raw = _corpus(tmp_path / "raw")
    table = "{ " + ", ".join(f"{k} = {v}" for k, v in weights.items()) + " }"
    out = train_tokenizer_from(str(raw), 400, tmp_path / "tok", mixture=table)
    record = json.loads((out / TRAINED_ON_FILE).read_text())
    rows = {row["name"]: row for row in record["sources"]}
    total = sum(row["bytes"] for row in rows.values())
    sizes = {name: [len(r.text.encode()) for r in scan_files(parse_source(str(raw / name)).files)]
             for name in weights}
    largest = max(max(v[:rows[n]["documents"]]) for n, v in sizes.items())  # the deviation is one document
    for name, weight in weights.items():
        assert rows[name]["bytes"] == sum(sizes[name][:rows[name]["documents"]])  # its first N documents
        assert abs(rows[name]["bytes"] - weight / sum(weights.values()) * total) <= largest
    ended = record["ended_by"]
    assert rows[ended]["documents"] == len(list(scan_files(parse_source(str(raw / ended)).files)))
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 400


def test_a_mixture_is_refused_in_one_line_before_anything_is_written(tmp_path):
    raw = _corpus(tmp_path / "raw")
    (raw / "mix.toml").write_text("mixture = { web = 1, code = 2 }\n")
    cases = [
        (str(raw), "{ web = 1, news = 1 }", "--mixture.news: .*raw/news does not exist"),
        (str(raw), "{ web = -1 }", "--mixture.web = -1: a weight must be a number >= 0"),
        (str(raw), "{ web = 0, code = 0 }", "--mixture: the weights sum to 0"),
        (str(raw), "web = 1", "--mixture: 'web = 1' is neither a table"),
        (str(raw / "code" / "c.jsonl"), "{ web = 1 }", "--mixture: its names are relative to --input"),
        (str(raw / "mix.toml"), "{ web = 1 }", "--mixture: set, but --input .* is a mixture file too"),
    ]
    for source, mixture, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            train_tokenizer_from(source, 400, tmp_path / "tok", mixture=mixture)
        assert "\n" not in str(err.value) and not (tmp_path / "tok").exists()
    # a mixture file as --input: names relative to it
    out = train_tokenizer_from(str(raw / "mix.toml"), 400, tmp_path / "tok")
    assert [row["weight"] for row in json.loads((out / "trained_on.json").read_text())["sources"]] == [1.0, 2.0]
