#!/usr/bin/env bash
# Column tiles per program of the pair's expand (config key N_TILES of moe_lora_expand: 1 = today's one
# tile per program, n = n consecutive tiles, the block's metadata, pairs and t loaded once for them) on
# one GPU, from the repository root, in one device call of under 10 minutes:
#   ci/gpu/run_expand_tiles.sh [OUT_DIR]        (default: $OUT, else gpu_run)
# 1. the A/B by the benchmark's method (benchmarks/config_ab.py: bench_moe_lora.py once per value on a
#    copy of the shipped table with the key on every moe_lora_expand entry), values 1 2 3 6 in that
#    order at M 8 32 128 512 x R 16 64, no value started after AB_BUDGET_S (200), all of it killed after
#    AB_TIMEOUT_S (280) -> OUT_DIR/ab/N_TILES_{1,2,3,6}.json (+ .log), N_TILES_ab.json, ab.log;
# 2. the variant's kernel tests on CUDA (gpu profile), MOELORA_MAX_EXAMPLES (30) examples, cut after
#    TESTS_BUDGET_S (120) -> kernels_expand_tiles.json, kernels_expand_tiles.log;
# 3. one bench_moe_lora.py run at the shipped table, every M x R 16 64 (the card's "done" runs, and the
#    check of the table's last entries), killed after BENCH_TIMEOUT_S (130) -> bench.json, bench.log.
set -uo pipefail
. "$(dirname "$0")/_script_env.sh"
mkdir -p "$OUT_DIR/ab"
status=0
timeout "${AB_TIMEOUT_S:-280}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/ab" --key N_TILES \
    --values 1 2 3 6 --ops moe_lora_expand --budget-s "${AB_BUDGET_S:-200}" \
    -- --tokens 8 32 128 512 --ranks 16 64 --no-baseline 2>&1 | tee "$OUT_DIR/ab.log" || status=1
MOELORA_MAX_EXAMPLES="${MOELORA_MAX_EXAMPLES:-30}" "$PY" ci/gpu/kernels_gpu.py --profile gpu \
    --tests test_kernel_expand_tiles.py --budget-s "${TESTS_BUDGET_S:-120}" \
    --out "$OUT_DIR/kernels_expand_tiles.json" 2>&1 | tee "$OUT_DIR/kernels_expand_tiles.log" || status=1
timeout "${BENCH_TIMEOUT_S:-130}" "$PY" benchmarks/bench_moe_lora.py --ranks 16 64 --no-baseline \
    --out "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.log" || status=1
exit $status
