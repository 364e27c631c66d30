#!/usr/bin/env bash
# The GPU benchmark (tools/bench/gpu.py) on one H100/H200: at most ~8 minutes, no network.
# Uses $PYTHON (default: .venv/bin/python if it exists, else python3), whose own torch (with
# CUDA) is never replaced; on a bare CUDA image, --wheels DIR installs what it lacks first
# (tools/gpu_wheels.sh, as for tools/gpu_check.sh). The repo is put on PYTHONPATH. The other
# arguments go to gpu.py, e.g.
#   bash tools/bench/gpu.sh --wheels .wheels --out /tmp/bench_gpu.json
#   bash tools/bench/gpu.sh --variants gamma_bf16 llama3_bf16 gamma_none_bf16
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
source tools/gpu/install.sh
gpu_prepare "$@" || exit 2  # sets args: the arguments left for the Python script
"$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"error: torch {torch.__version__} sees no CUDA device (bash tools/bench/gpu.sh needs one; "
             "python tools/bench/gpu.py --dry-run runs on the CPU)")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
PY
# Built-in tokenizer and shards first, outside the timed runs (cached for the variants).
"$PYTHON" -c "import gamma_titan; from gamma_titan.data.builtin_shards import ensure_builtin_shards; from gamma_titan.data.tokenizer import ensure_builtin_tokenizer; ensure_builtin_shards(ensure_builtin_tokenizer())"
exec "$PYTHON" tools/bench/gpu.py "${args[@]}"
