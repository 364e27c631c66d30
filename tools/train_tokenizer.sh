#!/usr/bin/env bash
# Build the built-in corpus and train the project's byte-level BPE tokenizer on it, once
# (cached in ~/.cache/gamma-titan or $GAMMA_TITAN_CACHE). Training configs name it with
# `hf_assets_path = "builtin"`; it is built on first use anyway.
#   bash tools/train_tokenizer.sh [--vocab-size N] [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/gamma-titan tokenizer train "$@"
