#!/usr/bin/env bash
# The wheels the bare CUDA image lacks (tools/gpu/wheels.lock.json: torchtitan, torchao, datasets,
# tyro, torchdata, tomli, tomli-w and what they need there), for CPython 3.12 on manylinux x86-64,
# plus this project's own wheel, into a git-ignored folder with manifest.json (name, version,
# sha256). Run it on a machine that reaches PyPI; then carry the folder to the GPU machine:
#   bash tools/gpu_wheels.sh [DIR]                  # default .wheels
#   bash tools/gpu_check.sh --wheels .wheels        # there: installs them, then runs the check
# `python tools/gpu/wheels.py lock` re-resolves the lock against tools/gpu/image_packages.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" tools/gpu/wheels.py download "${1:-.wheels}"
