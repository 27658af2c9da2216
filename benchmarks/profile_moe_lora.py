"""Where the MoE-LoRA delta's time goes, per stage and per kernel, at chosen (M, R) points.

Two modes on one GPU, on bench_moe_lora.py's problem (same shapes, seeds, pools and alignment):

- default: each stage (gate_up, down) of each path (``fused``: one kernel per stage; ``pair``: the
  shrink/expand pair) timed alone by bench_moe_lora.py's timer (CUDA graph, L2 flushed, median of
  ``--replays``); JSON to ``--out``.
- ``--eager N``: each (path, stage) run N times eagerly inside an NVTX range named ``path/stage``, for
  a profiler such as Nsight Compute (``ncu --nvtx``; benchmarks/profile_ncu.sh) to attribute
  counters to kernels; nothing is timed.

    PYTHONPATH=packages/core/src:packages/kernels/src:reference/src \\
        python benchmarks/profile_moe_lora.py --points 32:64 128:64 --out stages.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe_lora as bench

from moelora_kernels import moe_lora_delta


def stage_fns(p, w, h, gu, d):
    """{(path, stage): fn} adding the stage's delta into gu / d (the bench's buffers)."""
    fns = {}
    for path, fused in (("fused", True), ("pair", False)):
        fns[(path, "gate_up")] = lambda f=fused: moe_lora_delta(
            "gate_up", p.x, gu, w, p.lora_align, top_k=p.k, adapter_enabled=p.enabled, fused=f)
        fns[(path, "down")] = lambda f=fused: moe_lora_delta(
            "down", h, d, w, p.lora_align, top_k=p.k, topk_weights=p.topk_weights, adapter_enabled=p.enabled,
            fused=f)
    return fns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", required=True, help="M:R pairs, e.g. 32:64")
    parser.add_argument("--out", help="JSON output path (timing mode)")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--eager", type=int, default=0, help="run each (path, stage) N times in NVTX ranges")
    args = parser.parse_args()
    shape = bench.MODELS["qwen3-30b-a3b-layer"]
    gen = torch.Generator("cuda").manual_seed(0)
    H, I, E = shape["H"], shape["I"], shape["E"]  # noqa: E741
    base = {"w_gu": (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H ** 0.5).to(bench.DT),
            "w_d": (torch.randn(E, H, I, generator=gen, device="cuda") / I ** 0.5).to(bench.DT)}
    timer = bench.Timer(args.replays)
    pools, rows = {}, []
    for point in args.points:
        M, R = (int(v) for v in point.split(":"))
        if R not in pools:
            pools[R] = bench.make_pool(shape, R, gen)
        w = pools[R]
        p = bench.Problem(M, shape, gen, base)
        gate_up0, h, down0 = p.base_buffers()
        gu, d = gate_up0.clone(), down0.clone()
        fns = stage_fns(p, w, h, gu, d)
        row = {"M": M, "R": R, "block_m_lora": p.bm_lora}
        for (path, stage), fn in fns.items():
            if args.eager:
                for _ in range(args.eager):
                    timer.flush.zero_()
                    torch.cuda.nvtx.range_push(f"{path}/{stage}/M{M}/R{R}")
                    fn()
                    torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()
            else:
                row[f"{path}_{stage}_us"] = timer(fn)["median_us"]
        if not args.eager:
            row["both_fused_us"] = row["fused_gate_up_us"] + row["fused_down_us"]
            row["both_pair_us"] = row["pair_gate_up_us"] + row["pair_down_us"]
            print(json.dumps(row), flush=True)
        rows.append(row)
        del p
    if args.out and not args.eager:
        Path(args.out).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                              "device": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
