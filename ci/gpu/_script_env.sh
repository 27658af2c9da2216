# Sourced by the one-call GPU scripts (ci/gpu/run_*.sh) after their `set` line, with their arguments:
# the repository root as the working directory, OUT_DIR (the first argument, else $OUT, else gpu_run,
# created), real kernels (no TRITON_INTERPRET), PY (the interpreter with torch: $PYTHON, else python3)
# and the packages' source folders on PYTHONPATH (run from source, as on the GPU image).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT_DIR="${1:-${OUT:-gpu_run}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src
