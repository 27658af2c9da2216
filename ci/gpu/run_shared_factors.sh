#!/usr/bin/env bash
# Shared-outer / fully shared expert factors on one GPU (the H200), from the repository root:
#   ci/gpu/run_shared_factors.sh [OUT_DIR]        (default: $OUT, else gpu_run)
# 1. the kernel suite's stride-0 tests and the MoE-LoRA / virtual-experts files they extend, in the
#    gpu profile (bf16, Qwen3-30B-A3B shapes among the draws), under sync debug mode "error"
#    (ci/gpu/kernels_gpu.py) -> kernels_shared_factors.json;
# 2. the engine on the layout fixtures (reference, triton, csgmv on CUDA) -> engine_expert_layouts.log;
# 3. the benchmark rows of the stride-0 path next to the per-expert ones of the same session
#    (bench_moe_lora.py, R 16 and 64, every M) -> bench_per_expert.json, bench_shared_outer.json,
#    bench_fully_shared.json (+ .log).
set -euo pipefail
. "$(dirname "$0")/_script_env.sh"
status=0
"$PY" ci/gpu/kernels_gpu.py --profile gpu --out "$OUT_DIR/kernels_shared_factors.json" \
    --tests test_kernel_shared_factors.py --tests test_kernel_moe_lora.py --tests test_kernel_virtual_experts.py \
    2>&1 | tee "$OUT_DIR/kernels_shared_factors.log" || status=1
MOELORA_RUNNER_DEVICE=cuda PYTHONPATH="$PYTHONPATH:packages/runner/tests" "$PY" -m pytest \
    packages/runner/tests/test_engine_expert_layouts.py -p no:cacheprovider -q -rfEs \
    2>&1 | tee "$OUT_DIR/engine_expert_layouts.log" || status=1
for layout in per_expert shared_outer fully_shared; do
    "$PY" benchmarks/bench_moe_lora.py --out "$OUT_DIR/bench_$layout.json" --expert-layout "$layout" \
        2>&1 | tee "$OUT_DIR/bench_$layout.log" || status=1
done
exit $status
