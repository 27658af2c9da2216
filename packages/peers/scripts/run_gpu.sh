#!/usr/bin/env bash
# The peers' layer-suite cells on one GPU, from the repository root (no nox, no internet):
#   packages/peers/scripts/run_gpu.sh [OUT_DIR] [PATH...]     (default: $OUT, else gpu_run; all paths)
# Needs the folder built on the CPU machine by packages/peers/scripts/build_gpu_folder.py (.gpu/peers,
# carried to the GPU machine; never committed). Per peer path and profile (interpret-sized draws on
# CUDA at 2 examples per item, then the gpu profile at 2), one JSON report + log in OUT_DIR, and a
# probe of what each path loaded and substituted (probe-<path>.json).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT_DIR="${1:-${OUT:-gpu_run}}"; shift || true
PATHS=("${@:-sglang:legacy sglang:virtual_experts sglang:grouped vllm:fused}")
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
SITE=.gpu/peers/site
[ -d "$SITE" ] || "$PY" -m pip install --no-index --no-deps --target "$SITE" .gpu/peers/wheels/*.whl -q
export PYTHONUNBUFFERED=1 MOELORA_PEERS_ROOT="$PWD/.gpu/peers/root"
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src:packages/peers/src:$SITE
status=0
for p in ${PATHS[@]}; do
    target="moelora_peers.${p%%:*}:${p##*:}"
    name="${p/:/-}"
    "$PY" -c "from moelora_peers.grid import PeerPathSpec, probe; import json, sys; \
print(json.dumps(probe(PeerPathSpec('${p%%:*}', '${p##*:}', '$target'))))" > "$OUT_DIR/probe-$name.json" || status=1
    for profile in interpret gpu; do
        "$PY" -m pytest -p moelora_conformance.plugin --backend "$target" \
            --device cuda --profile "$profile" --max-examples 2 --no-shrink --hypothesis-seed=20261206 \
            -p no:cacheprovider -q --report-json "$OUT_DIR/peers-$name-$profile.json" \
            > "$OUT_DIR/peers-$name-$profile.log" 2>&1 || status=1
    done
done
exit $status
