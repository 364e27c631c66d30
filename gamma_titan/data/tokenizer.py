"""Byte-level BPE tokenizers: train one, cache the built-in one, resolve `model.hf_assets_path`.

The saved folder (tokenizer.json + tokenizer_config.json) loads unchanged in both
`torchtitan.components.tokenizer.HuggingFaceTokenizer` and
`transformers.PreTrainedTokenizerFast`:
  * the special tokens sit at fixed ids 0/1/2 and are named in tokenizer_config.json, which
    is where TorchTitan infers `bos_id` / `eos_id` from;
  * the tokenizer itself adds no BOS/EOS (no post-processor, `add_*_token: false`); TorchTitan
    adds them per document via `encode(text, add_bos=True, add_eos=True)`;
  * the 256 byte symbols are all in the vocabulary, so any text encodes without an unknown
    token and decodes back exactly.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from gamma_titan.data.builtin_corpus import (
    TRAIN_FILE,
    corpus_name,
    ensure_builtin_corpus,
    read_texts,
)
from gamma_titan.data.cache import build_once, cache_dir
from gamma_titan.data.clean_text import TextErrors, clean_texts
from gamma_titan.data.text_sources import TEXT_FIELD, load_source, parse_source
from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import damaged, load_tokenizer, read_json
from gamma_titan.files import TOKENIZER_FILE

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in this order

# Smallest useful vocabulary: the special tokens plus one token per byte.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
DEFAULT_BUILTIN_VOCAB = 4096

# transformers' convention for "no length limit" (its VERY_LARGE_INTEGER): the tokenizer has
# no maximum of its own; the model's context length is set by training.seq_len.
NO_MAX_LENGTH = int(1e30)

HF_ASSETS_KEY = "model.hf_assets_path"
#: What to do about a damaged file of a tokenizer folder.
TOKENIZER_HINT = "train the tokenizer again (`gamma-titan tokenizer train`) or point at another tokenizer folder"


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    *,
    model_max_length: int = NO_MAX_LENGTH,
) -> Path:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` ids; save it in `out_dir`."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # normalized=False: special tokens are matched on raw text, never rewritten.
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    tokenizer = Tokenizer(models.BPE())  # no unk token needed: every byte is in the vocab
    # GPT-2 style: split on the usual regex, map bytes to printable symbols; no prefix space
    # so that decode(encode(x)) == x.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,  # placed first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)

    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        # BPE stops early when the text has no pairs left to merge.
        raise ValueError(
            f"training text too small: reached {got} tokens of the {vocab_size} requested"
        )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, token

    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        # transformers would otherwise "clean up" spaces before punctuation when decoding.
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )
    return out_dir


def ensure_builtin_tokenizer(vocab_size: int = DEFAULT_BUILTIN_VOCAB, force: bool = False) -> Path:
    """Train (once, cached, safe across processes) a tokenizer on the built-in corpus.

    `force=True` retrains it even if cached (the corpus itself is reused).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"tokenizer vocab size: {vocab_size} is too small; "
            f"allowed: an integer >= {MIN_VOCAB_SIZE}"
        )
    name = f"{corpus_name()}-bpe{vocab_size}"

    def build(tmp: Path) -> None:
        corpus = ensure_builtin_corpus()
        start = time.perf_counter()
        try:
            train_bpe_tokenizer(read_texts(corpus / TRAIN_FILE), vocab_size, tmp)
        except ValueError as err:  # the corpus ran out of merges before vocab_size
            raise ConfigError(
                f"tokenizer vocab size: {vocab_size} is too large for the built-in corpus "
                f"({err}); use a smaller one"
            ) from None
        logger.info("trained tokenizer %s in %.1f s", name, time.perf_counter() - start)

    return build_once(cache_dir() / "tokenizer" / name, build, force)


#: What a tokenizer trained by `tokenizer train` was trained on (next to tokenizer.json).
TRAINED_ON_FILE = "trained_on.json"


def train_tokenizer_from(source: str, vocab_size: int, out_dir: str | Path, *, force: bool = False,
                         errors: TextErrors | None = None, mixture: str | None = None) -> Path:
    """`gamma-titan tokenizer train --input SOURCE [--mixture TABLE]`: a tokenizer trained on
    any text source (text_sources.py: local jsonl/json/parquet/txt files or folders, a
    save_to_disk folder, a hub id), or on several mixed by weight as shard folders are
    (`mixture`: `{ web = 0.7, code = 0.3 }` or a mixture file, names relative to the SOURCE
    folder; a mixture file as SOURCE alone, names relative to it). Text that is not clean is
    refused in one line; with `errors` (replace/skip, local files only) it is cleaned as it
    is read, counted in `errors`. `trained_on.json` records each source's documents, bytes
    and share of the text."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size {vocab_size}: must be an integer >= {MIN_VOCAB_SIZE}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise ConfigError(f"--out: {out_dir} exists and is not empty; use another folder, "
                          "or --force to replace the tokenizer in it")
    sources = _mixed_sources(source, mixture)
    streams = [_source_texts(value, errors) for _, value, _ in sources]  # every one opened (checked) first
    mix = WeightedTexts(streams, [weight for _, _, weight in sources])
    try:
        train_bpe_tokenizer(mix.batches(1000), vocab_size, out_dir)
    except ValueError as err:
        raise ConfigError(f"--vocab-size {vocab_size}: too large for {source} ({err}); use a smaller one") from None
    total = sum(mix.bytes) or 1
    record = {"vocab_size": vocab_size,
              "sources": [{"name": name, "input": value, "weight": weight, "documents": docs, "bytes": size,
                           "share": size / total}
                          for (name, value, weight), docs, size in zip(sources, mix.documents, mix.bytes)],
              "ended_by": None if len(sources) == 1 else sources[mix.ended_by][0],
              "text_errors": errors.as_dict() if errors is not None else None}
    (out_dir / TRAINED_ON_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return out_dir


def _mixed_sources(source: str, mixture: str | None) -> list[tuple[str, str, float]]:
    """(name, source string, weight) of each source the tokenizer reads."""
    from gamma_titan.data.mixture_table import (MIXTURE_FILE_SUFFIXES, mixture_weights, parse_mixture_option,
                                                read_mixture_file)

    base = Path(source).expanduser()
    if base.is_file() and base.suffix in MIXTURE_FILE_SUFFIXES:
        if mixture is not None:
            raise ConfigError(f"--mixture: set, but --input {source} is a mixture file too; keep one of them")
        table, key = read_mixture_file(base, "--input"), f"--input ({base.name})"
        base = base.parent
    elif mixture is not None:
        if not base.is_dir():
            raise ConfigError(f"--mixture: its names are relative to --input, which must then be a folder "
                              f"({source} is not one)")
        table, key = parse_mixture_option(mixture, "--mixture"), "--mixture"
    else:
        parse_source(source, "--input")
        return [(Path(source).name, source, 1.0)]
    out = []
    for name, weight in mixture_weights(table, key).items():
        path = base / name
        if not path.exists():
            raise ConfigError(f"{key}.{name}: {path} does not exist")
        parse_source(str(path), f"{key}.{name}")
        out.append((name, str(path), weight))
    return out


def _source_texts(value: str, errors: TextErrors | None) -> Iterator[str]:
    """One source's texts, opened (and, strict, read through for unclean text) now."""
    parsed = parse_source(value, "--input")
    if errors is not None:
        if parsed.kind != "files":
            raise ConfigError(f"--input: --errors {errors.policy} reads local .txt/.jsonl/.json/.parquet files; "
                              f"'{value}' is read strictly (leave --errors out)")
        return clean_texts(parsed.files, errors)  # read as trained on, not held
    ds = load_source(parsed, value, "--input")

    def texts() -> Iterator[str]:
        for batch in ds.iter(batch_size=1000):  # Dataset and IterableDataset alike
            for text in batch[TEXT_FIELD]:
                if not isinstance(text, str):  # a streamed hub record
                    raise ConfigError(f"--input: {value}: a record's '{TEXT_FIELD}' is not a string")
                yield text

    return texts()


class WeightedTexts:
    """Texts of several sources, each a share of the bytes in proportion to its weight: the
    next text comes from the source furthest below its share, and the mix ends when the
    first source runs out (so every share holds to within one document, none repeated)."""

    def __init__(self, streams: list[Iterator[str]], weights: list[float]):
        self.streams, self.weights = streams, weights
        self.documents, self.bytes = [0] * len(streams), [0] * len(streams)
        self.ended_by: int | None = None

    def __iter__(self) -> Iterator[str]:
        live = [i for i, w in enumerate(self.weights) if w > 0]
        while True:
            i = min(live, key=lambda s: self.bytes[s] / self.weights[s])
            text = next(self.streams[i], None)
            if text is None:
                self.ended_by = i
                return
            self.documents[i] += 1
            self.bytes[i] += len(text.encode("utf-8", "surrogatepass"))
            yield text

    def batches(self, size: int) -> Iterator[list[str]]:
        batch: list[str] = []
        for text in self:
            batch.append(text)
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch


def is_tokenizer_dir(path: Path) -> bool:
    """True if `path` holds files TorchTitan's HuggingFaceTokenizer can load as BPE."""
    return (path / TOKENIZER_FILE).is_file() or (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    )


def resolve_tokenizer_path(value: str, key: str = HF_ASSETS_KEY) -> Path:
    """Turn the `model.hf_assets_path` value into a tokenizer folder.

    "builtin" -> the cached built-in tokenizer (4096 tokens); "builtin:<n>" -> one with n
    tokens; anything else must be a local folder with tokenizer.json (or vocab.json and
    merges.txt).
    """
    text = str(value).strip()
    if text == "builtin":
        return ensure_builtin_tokenizer(DEFAULT_BUILTIN_VOCAB)
    if text.startswith("builtin:"):
        size = text.removeprefix("builtin:")
        if not re.fullmatch(r"[0-9]+", size) or int(size) < MIN_VOCAB_SIZE:
            raise ConfigError(
                f"{key}: '{text}' has a bad vocabulary size; "
                f'use "builtin" or "builtin:<n>" with an integer n >= {MIN_VOCAB_SIZE}'
            )
        return ensure_builtin_tokenizer(int(size))

    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{key}: '{text}' does not exist; "
            'use "builtin" or a local folder with tokenizer.json'
        )
    if not (path.is_dir() and is_tokenizer_dir(path)):
        raise ConfigError(
            f"{key}: '{text}' is not a tokenizer folder (no tokenizer.json); "
            'use "builtin" or a local folder with tokenizer.json'
        )
    return path.resolve()


def tokenizer_vocab_size(path: str | Path) -> int:
    """Number of token ids the model's embedding needs for the tokenizer in `path`.

    Mirrors what TorchTitan's HuggingFaceTokenizer ends up with: the base vocabulary plus
    any special tokens from tokenizer_config.json that it adds on load. Returned as
    (largest id + 1) so that a vocabulary with gaps still fits in the embedding.
    """
    path = Path(path)
    if (path / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(path / TOKENIZER_FILE, TOKENIZER_HINT)
    elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        tokenizer = Tokenizer(
            models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt"))
        )
    else:
        raise ConfigError(
            f"{HF_ASSETS_KEY}: '{path}' is not a tokenizer folder (no tokenizer.json); "
            'use "builtin" or a local folder with tokenizer.json'
        )

    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        config = read_json(config_file, TOKENIZER_HINT)
        if not isinstance(config, dict):
            raise damaged(config_file, "holds no JSON object", TOKENIZER_HINT)
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True) for t in _config_special_tokens(config)]
        )
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def _config_special_tokens(config: dict) -> list[str]:
    """Special-token strings named in a tokenizer_config.json (plain or AddedToken form)."""
    keys = ("bos", "eos", "pad", "unk", "sep", "cls", "mask")
    entries = [config.get(f"{key}_token") for key in keys]
    entries += list(config.get("added_tokens_decoder", {}).values())
    tokens = []
    for entry in entries:
        if isinstance(entry, dict):
            entry = entry.get("content")
        if isinstance(entry, str):
            tokens.append(entry)
    return tokens
