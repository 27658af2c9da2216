#!/usr/bin/env bash
# Both gate_up slices in one program (fused_moe_lora SLICES_PER_PROGRAM 2) on one GPU (the H200), from
# the repository root, in one device call of under 10 minutes:
#   ci/gpu/run_slices.sh [OUT_DIR]        (default: $OUT, else gpu_run)
# 1. the A/B by the benchmark's method (benchmarks/sweep_configs.py --variants --families d): gate_up
#    with SLICES_PER_PROGRAM 1 and 2 (the table's tiles and the BLOCK_K x BLOCK_N x N_SPLIT grid) next
#    to today's auto path, then both stages' deltas, at M 1 8 32 128 512 x R 16 64; stops starting
#    units after SWEEP_BUDGET_S (330) -> variants.json, log.txt, sweep.log;
# 2. the kernel tests of the variant on CUDA (bf16 among the dtypes, Qwen3-30B-A3B shapes among the
#    draws, sync debug mode "error"), MOELORA_MAX_EXAMPLES (15) examples, cut after TESTS_BUDGET_S (90)
#    -> kernels_slices.json, kernels_slices.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-gpu_run}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src
status=0
"$PY" benchmarks/sweep_configs.py --variants --families d --lora-tokens 1 8 32 128 512 --ranks 16 64 \
    --budget-s "${SWEEP_BUDGET_S:-330}" --out-dir "$OUT_DIR" 2>&1 | tee "$OUT_DIR/sweep.log" || status=1
MOELORA_MAX_EXAMPLES="${MOELORA_MAX_EXAMPLES:-15}" "$PY" ci/gpu/kernels_gpu.py --profile gpu \
    --tests test_kernel_slices_per_program.py --budget-s "${TESTS_BUDGET_S:-90}" \
    --out "$OUT_DIR/kernels_slices.json" 2>&1 | tee "$OUT_DIR/kernels_slices.log" || status=1
exit $status
