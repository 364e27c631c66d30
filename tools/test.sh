#!/usr/bin/env bash
# The test command (README, CI): set up .venv, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
