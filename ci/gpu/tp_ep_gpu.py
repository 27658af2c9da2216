"""TP = 2 / EP = 2 on two GPUs: NCCL, real CUDA graphs, bf16, sync debug mode "error".

The workload of the CPU tests (``packages/runner/tests/parallel_support.py``: three adapters of ranks
below R, base requests, evictions after capture, chunked prefill mixed with decodes) on every backend
(reference, triton, csgmv) × layout (tp2, ep2, tp2+ep2) × mode (eager; prefill ``full`` and
``breakable``, each with the decode graph; CUDA graphs captured at start-up), each rank on its own GPU,
compared with the same run at TP = 1 on rank 0's GPU within the ``tp_vs_tp1`` row of the dtype. Every
measurement is appended to ``<out-dir>/tp_vs_tp1.jsonl`` before it is checked; a summary table ends
the run; the exit status is non-zero when any case failed.

    ci/gpu/run_tp.sh "$OUT"                     # sets the environment below and starts torchrun
    # or by hand, from the repository root:
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:packages/runner/src:reference/src:\\
    conformance/src:packages/runner/tests torchrun --nproc-per-node 2 ci/gpu/tp_ep_gpu.py --out-dir "$OUT"

With fewer than two GPUs it prints ``SKIPPED: <reason>``, writes ``tp_ep_gpu.json`` with status
"skipped" and exits 0 (nothing was checked). ``--device cpu`` is a dry run of this script over gloo
(fp32, the Triton backends under ``TRITON_INTERPRET=1``): ``torchrun --nproc-per-node 2 ci/gpu/tp_ep_gpu.py
--device cpu --dtype float32 --backend reference``. Needs torch, triton, transformers + peft (the fixtures
are built locally by rank 0), prometheus_client, rich.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for src in ("packages/core/src", "packages/kernels/src", "packages/backends/src", "packages/runner/src",
            "reference/src", "conformance/src", "packages/runner/tests"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

from moelora_runner.parallel.comm import NO_MULTICAST_ENV  # noqa: E402

# NVLink multicast off before NCCL starts, whoever started this worker.
for _key, _value in NO_MULTICAST_ENV.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

LAYOUTS = ((2, 1), (1, 2), (2, 2))
MODES = ("eager", "full", "breakable")
BACKENDS = ("reference", "triton", "csgmv")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "gpu_run")))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backend", action="append", choices=BACKENDS, help="default: all")
    parser.add_argument("--model", default="qwen3_moe")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo dry run")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = args.out_dir / "tp_ep_gpu.json"
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        reason = f"{torch.cuda.device_count()} CUDA device(s) visible; the TP = 2 / EP = 2 NCCL run needs 2"
        print(f"SKIPPED: {reason}")
        record.write_text(json.dumps({"status": "skipped", "reason": reason}) + "\n")
        return 0

    import graph_support as gs
    import parallel_support as ps
    import runner_support as rs
    import torch.distributed as dist

    from moelora_runner.parallel.comm import init_group
    from moelora_runner.parallel.launch import torchrun_rank

    launched = torchrun_rank()
    if launched is None or launched[1] != 2:
        print("run under torchrun --nproc-per-node 2 (RANK / WORLD_SIZE not set, or not 2 ranks)", file=sys.stderr)
        return 2
    rank, world, local = launched
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    init_group(rank=rank, world=world, device=device)
    root = args.out_dir / "fixtures"
    if rank == 0 and not (root / "done").exists():
        from moelora_conformance.fixtures.build import build_fixtures

        build_fixtures(root / "fx")
        rs.build_engine_adapters(root / "adapters")
        (root / "done").write_text("ok\n")
    dist.barrier()
    models, adapters = root / "fx" / "models", rs.engine_adapter_dirs(root / "adapters")

    rows, single = [], {}
    for backend in args.backend or BACKENDS:
        for tp, ep in LAYOUTS:
            for mode in MODES:
                case = ps.Case(args.model, backend, tp, ep, mode)
                row = {"case": case.id, "dtype": args.dtype, "ranks": world, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
                try:
                    got = ps.run_case(case, models, adapters, device=args.device, dtype=args.dtype)
                    row["seconds"] = round(got["seconds"], 2)
                    if rank == 0:
                        key = case.single().id
                        if key not in single:  # TP = 1 on rank 0's GPU alone (rank 1 waits at the barrier)
                            single[key] = ps.run_case(case.single(), models, adapters, device=str(device),
                                                      dtype=args.dtype)
                        want = single[key]
                        if mode != "eager":
                            gs.assert_ran_on_graphs(got["passes"], mode)
                        row["max_abs"], row["mean_abs"] = gs.compare_outputs(
                            got["outputs"], want["outputs"], what=case.id, dtype=args.dtype, comparison="tp_vs_tp1",
                            record={"case": case.id, "ranks": world})
                    row["status"] = "passed"
                except Exception as exc:
                    row["status"] = "failed"
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    traceback.print_exc()
                dist.barrier()
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        record.write_text(json.dumps({"status": "done", "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                      "rows": rows}, indent=1) + "\n")
        print(f"\n{'case':<44} {'status':<7} {'max |Δ|':>9} {'mean |Δ|':>9} {'s':>6}")
        for r in rows:
            print(f"{r['case']:<44} {r['status']:<7} {r.get('max_abs', float('nan')):>9.2e} "
                  f"{r.get('mean_abs', float('nan')):>9.2e} {r.get('seconds', float('nan')):>6.1f}")
    failed = torch.tensor([sum(r["status"] != "passed" for r in rows)], device=device)
    dist.all_reduce(failed)
    dist.destroy_process_group()
    return 1 if int(failed.item()) else 0


if __name__ == "__main__":
    sys.exit(main())
