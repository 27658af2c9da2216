#!/usr/bin/env bash
# The MoE-LoRA shrink's A tiles through a TMA tensor descriptor (config key A_DESC of moe_lora_shrink and
# fused_moe_lora: 0 = masked pointer loads, today's; 1 = a descriptor over the pool's A rows for blocks
# whose slot's rank is the tile's BLOCK_R) on one GPU, from the repository root, in one device call of
# under 10 minutes:
#   ci/gpu/run_a_desc.sh [OUT_DIR]         (default: $OUT, else gpu_run)
# 1. the A/B by the benchmark's method (benchmarks/config_ab.py: bench_moe_lora.py once per value on a
#    copy of the shipped table with the key on every fused_moe_lora and moe_lora_shrink entry), values
#    0 1 at every M of the kernel-speed grid, R 16 and 64 (the deltas' column b and its fused / pair
#    columns move), no value started after AB_BUDGET_S (300), all of it killed after AB_TIMEOUT_S (380)
#    -> OUT_DIR/ab/A_DESC_{0,1}.json (+ .log), A_DESC_ab.json, ab.log;
# 2. the variant's kernel tests on CUDA (gpu profile), MOELORA_MAX_EXAMPLES (50) examples, cut after
#    TESTS_BUDGET_S (150) -> kernels_a_desc.json, kernels_a_desc.log.
set -uo pipefail
. "$(dirname "$0")/_script_env.sh"
mkdir -p "$OUT_DIR/ab"
status=0
timeout "${AB_TIMEOUT_S:-380}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/ab" --key A_DESC \
    --values 0 1 --ops fused_moe_lora moe_lora_shrink --budget-s "${AB_BUDGET_S:-300}" \
    -- --tokens 1 8 32 128 512 2048 8192 --ranks 16 64 --no-baseline 2>&1 | tee "$OUT_DIR/ab.log" || status=1
MOELORA_MAX_EXAMPLES="${MOELORA_MAX_EXAMPLES:-50}" "$PY" ci/gpu/kernels_gpu.py --profile gpu \
    --tests test_kernel_a_desc.py --budget-s "${TESTS_BUDGET_S:-150}" \
    --out "$OUT_DIR/kernels_a_desc.json" 2>&1 | tee "$OUT_DIR/kernels_a_desc.log" || status=1
exit $status
