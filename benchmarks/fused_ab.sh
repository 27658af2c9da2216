#!/usr/bin/env bash
# The fused_moe path (the MoE-LoRA deltas inside the base GEMMs) against the separate deltas, at
# each LORA_SLOT_GROUP (slots per shrink/expand tile pair; 0 = by rank), on a GPU host running from
# source. Usage: bash benchmarks/fused_ab.sh OUT_DIR [GROUP ...]  (default groups: 0 1 4)
# Each group writes OUT_DIR/fused_ab_g<G>.json (bench_moe_lora.py --path fused_moe) and its log.
set -u
out=${1:?OUT_DIR}; shift
groups=${*:-0 1 4}
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src
mkdir -p "$out"
for g in $groups; do
  cfg="${TMPDIR:-/tmp}/kernel_configs_g$g.json"
  python3 - "$g" "$cfg" <<'PY'
import json, sys
g, path = int(sys.argv[1]), sys.argv[2]
table = json.load(open("packages/kernels/src/moelora_kernels/configs/h200.json"))
for entry in table["fused_moe_gemm"]:
    entry["LORA_SLOT_GROUP"] = g
json.dump(table, open(path, "w"))
PY
  MOELORA_KERNEL_CONFIGS="$cfg" python3 benchmarks/bench_moe_lora.py --tokens 128 2048 8192 --ranks 16 64 \
    --path fused_moe --no-baseline --out "$out/fused_ab_g$g.json" > "$out/fused_ab_g$g.log" 2>&1
  echo "group $g: rc $?"; grep -E "layer separate" "$out/fused_ab_g$g.log"
done
