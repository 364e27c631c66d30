#!/usr/bin/env bash
# The GPU acceptance check (tools/gpu_check.py) on one H100/H200: at most ~8 minutes, no
# network, installs nothing. Uses $PYTHON (default: .venv/bin/python if it exists, else
# python3), which must already have torch with CUDA, torchtitan 0.2.x, torchao and this
# repo's dependencies; the repo is put on PYTHONPATH. Arguments go to gpu_check.py:
#   bash tools/gpu_check.sh [--out /tmp/gpu_check.json]
#   bash tools/gpu_check.sh --dry-run          # the same pipeline at debug shapes, on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
dry_run=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && dry_run=1; done
"$PYTHON" - "$dry_run" <<'PY'
import importlib, sys
missing = [m for m in ("torch", "torchtitan", "torchao", "tokenizers", "datasets", "tomli", "gamma_titan")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: {sys.executable} lacks {', '.join(missing)} (this script installs nothing)")
import torch
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} sees no CUDA device (bash tools/gpu_check.sh needs one; "
             "--dry-run runs on the CPU)")
print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
                                      if torch.cuda.is_available() else ", CPU"))
PY
# Built-in tokenizer and shards first, outside the timed checks (cached for every run).
"$PYTHON" -c "import gamma_titan; from gamma_titan.data.builtin_shards import ensure_builtin_shards; from gamma_titan.data.tokenizer import ensure_builtin_tokenizer; ensure_builtin_shards(ensure_builtin_tokenizer())"
exec "$PYTHON" tools/gpu_check.py "$@"
