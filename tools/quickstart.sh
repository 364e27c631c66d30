#!/usr/bin/env bash
# The main job (README): set up .venv, then pretrain the debug model on CPU, offline,
# on the built-in corpus (the corpus and tokenizer are built on first use, ~10 s).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/gamma-titan train configs/dense/debug.toml "$@"
