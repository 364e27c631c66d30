"""Offline data layer: a built-in corpus, a byte-level BPE tokenizer and TorchTitan datasets.

Modules (import the one you need; this package imports nothing heavy on its own):
  cache           -- cache folder, cross-process file lock, atomic folder builds
  builtin_corpus  -- English corpus generated from CPython's own documentation
  tokenizer       -- train / cache / resolve byte-level BPE tokenizers
  datasets        -- register "builtin", "builtin_validation" and "hf" with TorchTitan
"""
