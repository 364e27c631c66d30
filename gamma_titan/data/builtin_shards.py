"""The built-in corpus pretokenized: the shard folders the "builtin" datasets read, one per
source (docs, code).

Built once per (source, tokenizer) into the cache, safe across processes like every cached
asset (cache.py); the folder name carries the tokenizer's hash, so shards are never read
with a tokenizer other than the one that wrote them.
"""

from __future__ import annotations

from pathlib import Path

from gamma_titan.data.builtin_corpus import TRAIN_FILE, VALIDATION_FILE, corpus_name, ensure_builtin_corpus
from gamma_titan.data.cache import build_once, cache_dir
from gamma_titan.data.names import BUILTIN_DOCS
from gamma_titan.data.pretokenize import pretokenize
from gamma_titan.data.shards import tokenizer_info


def ensure_builtin_shards(tokenizer_dir: str | Path, source: str = BUILTIN_DOCS) -> Path:
    """A source of the built-in corpus pretokenized with this tokenizer (built once, cached)."""
    info = tokenizer_info(tokenizer_dir)
    corpus = ensure_builtin_corpus(source=source)

    def build(tmp: Path) -> None:
        pretokenize(str(corpus / TRAIN_FILE), tokenizer_dir, tmp, val_input=str(corpus / VALIDATION_FILE),
                    progress=False)

    return build_once(cache_dir() / "shards" / f"{corpus_name(source)}-{info.sha256[:12]}", build)
