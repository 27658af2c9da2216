#!/usr/bin/env bash
# The fused_moe path (the MoE-LoRA deltas inside the base GEMMs) against the separate deltas, at
# each LORA_SLOT_GROUP (slots per shrink/expand tile pair; 0 = by rank), on a GPU host running from
# source. Usage: bash benchmarks/fused_ab.sh OUT_DIR [GROUP ...]  (default groups: 0 1 4)
# Each group writes OUT_DIR/LORA_SLOT_GROUP_<G>.json (bench_moe_lora.py --path fused_moe) and its
# log, through benchmarks/config_ab.py (the key set on every fused_moe_gemm entry of a table copy).
set -u
out=${1:?OUT_DIR}; shift
groups=${*:-0 1 4}
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src
# shellcheck disable=SC2086  # the groups are words
python3 benchmarks/config_ab.py --out-dir "$out" --key LORA_SLOT_GROUP --values $groups --ops fused_moe_gemm \
  -- --tokens 128 2048 8192 --ranks 16 64 --path fused_moe --no-baseline
