#!/usr/bin/env bash
# The GPU benchmark (tools/bench/gpu.py) on one H100/H200: at most ~8 minutes, no network,
# installs nothing. Uses $PYTHON (default: .venv/bin/python if it exists, else python3),
# which must already have torch with CUDA, torchtitan 0.2.x, torchao and this repo's
# dependencies; the repo itself is put on PYTHONPATH. Arguments go to gpu.py, e.g.
#   bash tools/bench/gpu.sh --out /tmp/bench_gpu.json
#   bash tools/bench/gpu.sh --variants gamma_bf16 llama3_bf16 gamma_none_bf16
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$PYTHON" - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "torchtitan", "torchao", "tokenizers", "datasets", "tomli") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: {sys.executable} lacks {', '.join(missing)} (this script installs nothing)")
import torch
if not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} sees no CUDA device (bash tools/bench/gpu.sh needs one; "
             "python tools/bench/gpu.py --dry-run runs on the CPU)")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
PY
# Built-in tokenizer and shards first, outside the timed runs (cached for the variants).
"$PYTHON" -c "import gamma_titan; from gamma_titan.data.builtin_shards import ensure_builtin_shards; from gamma_titan.data.tokenizer import ensure_builtin_tokenizer; ensure_builtin_shards(ensure_builtin_tokenizer())"
exec "$PYTHON" tools/bench/gpu.py "$@"
