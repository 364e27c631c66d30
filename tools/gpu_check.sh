#!/usr/bin/env bash
# The GPU acceptance check (tools/gpu_check.py) on a bare CUDA image: at most 8 minutes from a
# cold machine, the install included; no network. Uses $PYTHON (default: .venv/bin/python if it
# exists, else python3), whose own torch (with CUDA) is never replaced.
#   bash tools/gpu_wheels.sh                        # here, with PyPI: the wheels into .wheels/
#   timeout 590 bash tools/gpu_check.sh --wheels .wheels --report-dir "$OUT" [--only NAME]   # there
#   bash tools/gpu_check.sh --dry-run               # the same pipeline at debug shapes, on the CPU
# --report-dir DIR: also everything printed, into DIR/console.log.
# --wheels DIR: checks DIR against its manifest (sha256), installs its wheels with
# `pip install --no-index --no-deps --target` into a temporary folder put on PYTHONPATH, then
# checks that what this Python now has meets the project's dependency closure.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
for ((i = 1; i <= $#; i++)); do  # the console into the report, from the first line on
  case "${!i}" in
    --report-dir) j=$((i + 1)); report_dir="${!j:-}" ;;
    --report-dir=*) report_dir="${!i#--report-dir=}" ;;
  esac
done
if [[ -n "${report_dir:-}" ]]; then
  mkdir -p "$report_dir" && exec > >(tee -a "$report_dir/console.log") 2>&1
fi
source tools/gpu/install.sh
gpu_prepare "$@" || exit 2  # sets args: the arguments left for the Python script
# Built-in tokenizer and shards first, outside the timed checks (cached for every run).
"$PYTHON" -c "import gamma_titan; from gamma_titan.data.builtin_shards import ensure_builtin_shards; from gamma_titan.data.tokenizer import ensure_builtin_tokenizer; ensure_builtin_shards(ensure_builtin_tokenizer())"
echo "ready after $((SECONDS - started)) s (install and built-in assets)"
exec "$PYTHON" tools/gpu_check.py "${args[@]}"
