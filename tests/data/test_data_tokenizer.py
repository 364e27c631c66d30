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
