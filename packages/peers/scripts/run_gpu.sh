#!/usr/bin/env bash
# The peers' layer-suite cells on one GPU, from the repository root (no nox, no internet):
#   packages/peers/scripts/run_gpu.sh [OUT_DIR] [PATH...]     (default: $OUT, else gpu_run; all paths)
# Needs the folder built on the CPU machine by packages/peers/scripts/build_gpu_folder.py (.gpu/peers,
# carried to the GPU machine; never committed). Per peer path and profile (interpret-sized draws on
# CUDA, then the gpu profile, $PEERS_MAX_EXAMPLES examples per item, default 2), one JSON report + log
# in OUT_DIR, and a probe of what each path loaded and substituted (probe-<path>.json). Each cell is
# cut at $PEERS_CELL_TIMEOUT seconds (default 45: 4 paths x 2 profiles stay within 9 minutes) with
# SIGINT, so pytest still writes the JSON report of the items it ran; summary.txt lists every cell's
# exit status (124: cut by the budget).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT_DIR="${1:-${OUT:-gpu_run}}"; shift || true
if [ "$#" -gt 0 ]; then PATHS=("$@"); else PATHS=(sglang:legacy sglang:virtual_experts sglang:grouped vllm:fused); fi
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
SITE=.gpu/peers/site
[ -d "$SITE" ] || "$PY" -m pip install --no-index --no-deps --target "$SITE" .gpu/peers/wheels/*.whl -q
export PYTHONUNBUFFERED=1 MOELORA_PEERS_ROOT="$PWD/.gpu/peers/root"
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src:packages/peers/src:$SITE
CELL_TIMEOUT="${PEERS_CELL_TIMEOUT:-45}"
EXAMPLES="${PEERS_MAX_EXAMPLES:-2}"
status=0
for p in "${PATHS[@]}"; do
    target="moelora_peers.${p%%:*}:${p##*:}"
    name="${p/:/-}"
    "$PY" -c "from moelora_peers.grid import PeerPathSpec, probe; import json; \
print(json.dumps(probe(PeerPathSpec('${p%%:*}', '${p##*:}', '$target'))))" > "$OUT_DIR/probe-$name.json" || status=1
    for profile in interpret gpu; do
        timeout -s INT -k 10 "$CELL_TIMEOUT" "$PY" -m pytest -p moelora_conformance.plugin --backend "$target" \
            --device cuda --profile "$profile" --max-examples "$EXAMPLES" --no-shrink --hypothesis-seed=20261206 \
            -p no:cacheprovider -q --report-json "$OUT_DIR/peers-$name-$profile.json" \
            > "$OUT_DIR/peers-$name-$profile.log" 2>&1
        rc=$?
        echo "$p $profile exit $rc" | tee -a "$OUT_DIR/summary.txt"
        [ "$rc" -eq 0 ] || status=1
    done
done
exit $status
