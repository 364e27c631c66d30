#!/usr/bin/env bash
# The test command (README, CI): set up .venv, then run the whole suite on CPU.
# Two pytest-xdist workers, one test file each at a time (module fixtures stay shared):
# much of the suite is single-threaded start-up of trainer processes, which overlaps well.
# GAMMA_TITAN_TEST_WORKERS=1 runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
workers="${GAMMA_TITAN_TEST_WORKERS:-2}"
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 "${xdist[@]}" "$@"
