#!/usr/bin/env bash
# The expand's factor loads (config key EXPAND_STREAM of moe_lora_expand and fused_moe_lora: 0 = today's
# exact-rank masks, 1 = 16-byte t and B loads, 2-3 = also the fused kernel's expand loop pipelined that
# many stages deep) on one GPU (the H200), from the repository root, in one device call of under 9
# minutes:
#   ci/gpu/run_expand_stream.sh [OUT_DIR]        (default: $OUT, else gpu_run)
# 1. the A/B by the benchmark's method (benchmarks/config_ab.py: bench_moe_lora.py once per value on a
#    copy of the shipped table with the key on every moe_lora_expand and fused_moe_lora entry), values
#    0 1 3 2 in that order at M 8 32 128 512 x R 16 64, no value started after AB_BUDGET_S (200),
#    all of it killed after AB_TIMEOUT_S (300)
#    -> OUT_DIR/ab/EXPAND_STREAM_{0,1,3,2}.json (+ .log), EXPAND_STREAM_ab.json (side by side), ab.log;
# 2. the kernel tests of the variant and of the config table on CUDA (gpu profile: bf16 among the
#    dtypes, Qwen3-30B-A3B shapes among the draws, sync debug mode "error"), MOELORA_MAX_EXAMPLES (30)
#    examples, cut after TESTS_BUDGET_S (140) -> kernels_expand_stream.json, kernels_expand_stream.log;
# 3. one bench_moe_lora.py run at the shipped table (EXPAND_STREAM 0 there until the A/B says
#    otherwise), M 1 8 32 128 512 x R 16 64, killed after BENCH_TIMEOUT_S (100) -> bench.json, bench.log.
set -uo pipefail
. "$(dirname "$0")/_script_env.sh"
mkdir -p "$OUT_DIR/ab"
status=0
timeout "${AB_TIMEOUT_S:-300}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/ab" --key EXPAND_STREAM \
    --values 0 1 3 2 --ops moe_lora_expand fused_moe_lora --budget-s "${AB_BUDGET_S:-200}" \
    -- --tokens 8 32 128 512 --ranks 16 64 --no-baseline 2>&1 | tee "$OUT_DIR/ab.log" || status=1
MOELORA_MAX_EXAMPLES="${MOELORA_MAX_EXAMPLES:-30}" "$PY" ci/gpu/kernels_gpu.py --profile gpu \
    --tests test_kernel_configs.py --tests test_kernel_expand_stream.py --budget-s "${TESTS_BUDGET_S:-140}" \
    --out "$OUT_DIR/kernels_expand_stream.json" 2>&1 | tee "$OUT_DIR/kernels_expand_stream.log" || status=1
timeout "${BENCH_TIMEOUT_S:-100}" "$PY" benchmarks/bench_moe_lora.py --tokens 1 8 32 128 512 --ranks 16 64 \
    --no-baseline --out "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.log" || status=1
exit $status
