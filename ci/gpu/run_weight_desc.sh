#!/usr/bin/env bash
# The base grouped GEMM's weight tiles through a TMA tensor descriptor (config key W_DESC of
# fused_moe_gemm: 0 = masked pointer loads, today's; 1 = a descriptor over the weight's rows, where the
# layout allows one) on one GPU, from the repository root, in one device call of under 10 minutes:
#   ci/gpu/run_weight_desc.sh [OUT_DIR]         (default: $OUT, else gpu_run)
# 1. the A/B by the benchmark's method (benchmarks/config_ab.py: bench_moe_lora.py once per value on a
#    copy of the shipped table with the key on every fused_moe_gemm entry), values 0 1 at every M of the
#    kernel-speed grid, R 16 (the base column a is the one the key moves), no value started after
#    AB_BUDGET_S (230), all of it killed after AB_TIMEOUT_S (300) -> OUT_DIR/ab/W_DESC_{0,1}.json
#    (+ .log), W_DESC_ab.json, ab.log;
# 2. the variant's kernel tests on CUDA (gpu profile), MOELORA_MAX_EXAMPLES (50) examples, cut after
#    TESTS_BUDGET_S (150) -> kernels_weight_desc.json, kernels_weight_desc.log.
set -uo pipefail
. "$(dirname "$0")/_script_env.sh"
mkdir -p "$OUT_DIR/ab"
status=0
timeout "${AB_TIMEOUT_S:-300}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/ab" --key W_DESC \
    --values 0 1 --ops fused_moe_gemm --budget-s "${AB_BUDGET_S:-230}" \
    -- --tokens 1 8 32 128 512 2048 8192 --ranks 16 --no-baseline 2>&1 | tee "$OUT_DIR/ab.log" || status=1
MOELORA_MAX_EXAMPLES="${MOELORA_MAX_EXAMPLES:-50}" "$PY" ci/gpu/kernels_gpu.py --profile gpu \
    --tests test_kernel_weight_desc.py --budget-s "${TESTS_BUDGET_S:-150}" \
    --out "$OUT_DIR/kernels_weight_desc.json" 2>&1 | tee "$OUT_DIR/kernels_weight_desc.log" || status=1
exit $status
