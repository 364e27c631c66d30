#!/usr/bin/env bash
# Create .venv in the repo root and install gamma-titan into it (idempotent).
# torch comes first, pinned to the CPU wheel that ships with these machines; on a GPU
# node, install the CUDA build of torch (same version range) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import gamma_titan, torchtitan; print('gamma-titan ready: torchtitan', torchtitan.__version__)"
