#!/usr/bin/env bash
# Programmatic dependent launch (config key PDL of every op of the fused MoE layer: both alignments, the
# base GEMMs, the fp8 activation quantization, the activation and top-k sum (moe_epilogue) and the three
# MoE-LoRA kernels; 0 = ordinary launches, today's; 1 = each kernel launched with PDL, its programs waiting
# for the stream's previous grid before their first load) on one sm_90 GPU, from the repository root, in
# one device call of under 10 minutes:
#   ci/gpu/run_pdl.sh [OUT_DIR]         (default: $OUT, else gpu_run)
# 1. the variant's GPU tests first (gpu profile: each kernel after a late-writing producer, the layer in a
#    CUDA graph, against the ordinary launches bit for bit), cut after TESTS_BUDGET_S (120)
#    -> kernels_pdl.json, kernels_pdl.log;
# 2. the A/B by the benchmark's method (benchmarks/config_ab.py: bench_moe_lora.py once per value on a
#    copy of the shipped table with the key on every entry of those ops), values 0 1 at M 1-512 (where
#    launches weigh most), R 16 and 64 (the base a, the deltas' b and the alignment c all move), no value
#    started after AB_BUDGET_S (280), all of it killed after AB_TIMEOUT_S (360) -> OUT_DIR/ab/PDL_{0,1}.json
#    (+ .log), PDL_ab.json, ab.log.
set -uo pipefail
. "$(dirname "$0")/_script_env.sh"
mkdir -p "$OUT_DIR/ab"
status=0
"$PY" ci/gpu/kernels_gpu.py --profile gpu --out "$OUT_DIR/kernels_pdl.json" --budget-s "${TESTS_BUDGET_S:-120}" \
    --tests test_kernel_pdl.py -- -k "producers or cuda_graph" 2>&1 | tee "$OUT_DIR/kernels_pdl.log" || status=1
timeout "${AB_TIMEOUT_S:-360}" "$PY" benchmarks/config_ab.py --out-dir "$OUT_DIR/ab" --key PDL \
    --values 0 1 --ops moe_align_block_size moe_lora_align_block_size fused_moe_gemm quantize_activation_fp8 \
    moe_epilogue moe_lora_shrink moe_lora_expand fused_moe_lora \
    --budget-s "${AB_BUDGET_S:-280}" \
    -- --tokens 1 8 32 128 512 --ranks 16 64 --no-baseline 2>&1 | tee "$OUT_DIR/ab.log" || status=1
exit $status
