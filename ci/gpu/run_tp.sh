#!/usr/bin/env bash
# TP = 2 / EP = 2 on two GPUs with NCCL and real CUDA graphs (ci/gpu/tp_ep_gpu.py), from the repository
# root: ci/gpu/run_tp.sh OUT_DIR [extra tp_ep_gpu.py arguments]. NVLink multicast stays off for every
# torchrun worker (exported here, inherited by each; tp_ep_gpu.py sets them again before NCCL starts).
# Fewer than two GPUs: tp_ep_gpu.py prints SKIPPED with the reason and exits 0.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-gpu_run}}"; shift || true
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:conformance/src:packages/runner/tests
PY="${PYTHON:-python3}"   # the interpreter with torch (python3 on the H200 image)
mkdir -p "$OUT_DIR"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
    exec "$PY" ci/gpu/tp_ep_gpu.py --out-dir "$OUT_DIR" "$@"   # prints SKIPPED with the reason
fi
set -o pipefail
"$PY" -m torch.distributed.run --nproc-per-node 2 ci/gpu/tp_ep_gpu.py --out-dir "$OUT_DIR" "$@" 2>&1 \
    | tee "$OUT_DIR/tp_ep_gpu.log"
