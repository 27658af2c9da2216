#!/usr/bin/env bash
# The base fused MoE's tiles on a card whose table has not been swept at large M (the H200's: no BLOCK_M
# 128, no GROUP_SIZE_M, no fp8 entries; benchmarks/RESULTS.md compares them tile by tile with the peer's
# shipped config), from the repository root, in one device call of under 10 minutes:
#   ci/gpu/run_base_tiles.sh [OUT_DIR]          (default: $OUT, else gpu_run)
# 1. the base GEMM's candidates at BLOCK_M 64 and 128 against the table in the same run (sweep_configs.py
#    --ops fused_moe_gemm --block-m 64 128 --wide, M 512 2048 8192), killed after SWEEP_TIMEOUT_S (270)
#    -> sweep_base.json, sweep_base.log;
# 2. GROUP_SIZE_M 0 8 16 of the base GEMM (config_ab.py, M 512 2048 8192, R 16), no value started after
#    GSM_BUDGET_S (110), killed after GSM_TIMEOUT_S (160) -> gsm/GROUP_SIZE_M_*.json, gsm.log;
# 3. QUANT_ROWS 1 16 of the fp8 base's activation quantization (config_ab.py --base-quant fp8, same M),
#    no value started after QR_BUDGET_S (80), killed after QR_TIMEOUT_S (120) -> qr/QUANT_ROWS_*.json, qr.log.
# Entries ship through the card's table only from what these measure (benchmarks/README.md).
set -uo pipefail
. "$(dirname "$0")/_script_env.sh"
mkdir -p "$OUT_DIR/gsm" "$OUT_DIR/qr"
status=0
timeout "${SWEEP_TIMEOUT_S:-270}" "$PY" benchmarks/sweep_configs.py --ops fused_moe_gemm --tokens 512 2048 8192 \
    --block-m 64 128 --wide --out "$OUT_DIR/sweep_base.json" 2>&1 | tee "$OUT_DIR/sweep_base.log" || status=1
timeout "${GSM_TIMEOUT_S:-160}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/gsm" --key GROUP_SIZE_M \
    --values 0 8 16 --ops fused_moe_gemm --budget-s "${GSM_BUDGET_S:-110}" \
    -- --tokens 512 2048 8192 --ranks 16 --no-baseline 2>&1 | tee "$OUT_DIR/gsm.log" || status=1
timeout "${QR_TIMEOUT_S:-120}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/qr" --key QUANT_ROWS \
    --values 1 16 --ops quantize_activation_fp8 --budget-s "${QR_BUDGET_S:-80}" \
    -- --base-quant fp8 --tokens 512 2048 8192 --ranks 16 --no-baseline 2>&1 | tee "$OUT_DIR/qr.log" || status=1
exit $status
