# Sourced by tools/gpu_check.sh and tools/bench/gpu.sh (from the repo root, with $PYTHON set).
# `gpu_prepare ARGS...` takes `--wheels DIR` out of ARGS (the rest into the array `args`),
# installs DIR's wheels if given, then checks the dependency closure.
# `gpu_install_wheels DIR` checks DIR against its manifest (sha256, never the image's torch
# stack), installs its wheels with `pip install --no-index --no-deps --target` into a
# temporary folder and puts it on PYTHONPATH behind the working tree; `gpu_check_closure`
# then checks what $PYTHON has against the project's dependency closure.
gpu_install_wheels() {
  local wheels="$1" site started=$SECONDS
  [[ -d "$wheels" ]] || { echo "error: --wheels $wheels: no such folder" >&2; return 2; }
  "$PYTHON" tools/gpu/wheels.py verify "$wheels" || return 2
  site="$(mktemp -d "${TMPDIR:-/tmp}/gamma-titan-site.XXXXXX")"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$site" "$wheels"/*.whl || return 2
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"  # the working tree first: its gamma_titan is the one run
  echo "installed $(ls "$wheels"/*.whl | wc -l) wheels into $site in $((SECONDS - started)) s"
}

gpu_check_closure() {
  "$PYTHON" tools/gpu/wheels.py installed || {
    echo "error: $("$PYTHON" -c 'import sys; print(sys.executable)') lacks what the project needs (above); on a bare image pass --wheels DIR" >&2
    return 2
  }
}

gpu_prepare() {
  local wheels=""
  args=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --wheels) [[ $# -ge 2 ]] || { echo "error: --wheels needs a folder" >&2; return 2; }; wheels="$2"; shift 2 ;;
      --wheels=*) wheels="${1#--wheels=}"; shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  if [[ -n "$wheels" ]]; then gpu_install_wheels "$wheels" || return 2; fi
  gpu_check_closure
}
