"""Shared fixtures: the built-in corpus and tokenizer, built at most once per session.

They live in the real cache (`$GAMMA_TITAN_CACHE` or ~/.cache/gamma-titan), so after the
first run these fixtures cost nothing. Tests of the caching itself use a tmp cache instead.
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def builtin_corpus() -> Path:
    from gamma_titan.data.builtin_corpus import ensure_builtin_corpus

    return ensure_builtin_corpus()


@pytest.fixture(scope="session")
def builtin_tokenizer(builtin_corpus) -> Path:
    from gamma_titan.data.tokenizer import ensure_builtin_tokenizer

    return ensure_builtin_tokenizer(4096)


@pytest.fixture(scope="session")
def titan_tokenizer(builtin_tokenizer):
    """TorchTitan's own tokenizer class loading our built-in tokenizer folder."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(builtin_tokenizer))

