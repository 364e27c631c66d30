"""Session fixtures."""

import pytest

import gamma_titan  # noqa: F401  (platform shims before torchtitan)


@pytest.fixture(scope="session")
def builtin_assets():
    """Build the built-in corpus and tokenizer once per session (cached across runs)."""
    from gamma_titan.data.builtin_corpus import ensure_builtin_corpus
    from gamma_titan.data.tokenizer import ensure_builtin_tokenizer

    return ensure_builtin_corpus(), ensure_builtin_tokenizer()
