"""Block-config sweep for the H200 table (``moelora_kernels/configs/h200.json``), by the benchmark's method.

For each (op, stage, M, R) it times every candidate config of the kernel (CUDA graph, L2 flushed,
median of ``--replays``) and prints the best ones, as JSON entries ready to paste into the table.
Ops: ``fused_moe_lora`` (the fused shrink+expand per stage), ``fused_moe_gemm`` (base gate_up /
down) and ``fp8_moe_gemm`` (the w8a8 base GEMMs over fp8 weights at block 128 × 128, the activations
quantized once outside the timing; every candidate at each ``--block-m``, default 16 32 64 128: its
table entries carry ``BLOCK_M``, one per row bound for both stages, which share an alignment).
Candidates that fail to compile or launch (e.g. too much shared memory) are reported and skipped.

    PYTHONPATH=packages/core/src:packages/kernels/src:reference/src python benchmarks/sweep_configs.py \\
        [--ops fused_moe_lora fused_moe_gemm] [--tokens 1 32 128 512] [--ranks 16 64] [--out sweep.json] \\
        [--wide]

``--variants`` A/Bs the selectable kernel variants instead (``variants.py`` beside this file): the
shrink/expand pair's tiles against the table's paths (b) and the alignment's programs per slot
(``ALIGN_SPLIT``, c; ``--families`` picks among them), by the same method with 100 replays,
writing JSON and a progress log into ``--out-dir`` (``$OUT`` on the GPU machine). ``--dry-run`` runs
the whole script on the CPU under ``TRITON_INTERPRET=1`` at tiny shapes (fp32, one timed call per
unit) so it cannot crash on the GPU for a reason a CPU would show.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for src in ("packages/core/src", "packages/kernels/src", "reference/src"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_moe_lora import MODELS, Problem, Timer, make_pool  # noqa: E402

from moelora_kernels import fused_moe_gemm, fused_moe_lora, moe_align_block_size, stage_tensors  # noqa: E402
from moelora_kernels.fp8_block import fp8_moe_gemm, quantize_activation_fp8  # noqa: E402

LORA_CANDIDATES = [
    dict(zip(("BLOCK_K", "BLOCK_N", "N_SPLIT", "num_warps", "num_stages"), c))
    for c in itertools.product((128, 256), (128, 256), (1, 2, 4), (4,), (3,))
]
# --wide: the axes the default grid holds fixed (warps, pipeline depth, the expand's load order), at
# the tiles the table uses from M = 32 up; 64 candidates a unit (about a minute a unit on the H200)
LORA_WIDE_CANDIDATES = [
    dict(zip(("BLOCK_K", "BLOCK_N", "N_SPLIT", "num_warps", "num_stages", "EXPAND_LOADS"), c))
    for c in itertools.product((64, 128), (128, 256), (1, 2), (4, 8), (3, 4), (1, 2))
]
GEMM_CANDIDATES = [
    dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), c))
    for c in itertools.product((64, 128), (64, 128), (4, 8), (4,))
]
# --wide with --block-m: the base GEMM's tiles at large M, where a deeper or wider tile may pay
# (16 candidates a (stage, M, BLOCK_M) unit; those over the 227 KiB of shared memory are skipped)
#: The w8a8 GEMM's tiles: BLOCK_K is the weights' K-group (128), so the axes are BLOCK_N, warps and depth.
FP8_GEMM_CANDIDATES = [
    dict(zip(("BLOCK_N", "num_warps", "num_stages"), c))
    for c in itertools.product((64, 128, 256), (4, 8), (3, 4))
]
FP8_BLOCK_MS = (16, 32, 64, 128)
GEMM_WIDE_CANDIDATES = [
    dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), c))
    for c in itertools.product((128, 256), (64, 128), (4, 8), (3, 4))
]


def sweep_lora(p, w, timer, stage, h, gate_up, down, candidates=LORA_CANDIDATES):
    t = stage_tensors(w, stage)
    x, out = (p.x, gate_up.clone()) if stage == "gate_up" else (h, down.clone())
    kw = {"stage": stage, "top_k": p.k, "ranks": t["ranks"], "scalings": t["scalings"],
          "adapter_enabled": p.enabled, "topk_weights": p.topk_weights if stage == "down" else None}
    # the table's own entry first: the baseline in the same run (config=None looks it up)
    results = [(timer(lambda: fused_moe_lora(x, t["lora_a"], t["lora_b"], p.lora_align, out, **kw))["median_us"],
                {"table": 1})]
    for cfg in candidates:
        try:
            r = timer(lambda cfg=cfg: fused_moe_lora(x, t["lora_a"], t["lora_b"], p.lora_align, out, config=cfg,
                                                     **kw))
            results.append((r["median_us"], cfg))
        except Exception as exc:  # a config the GPU cannot run: report and go on
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
    return sorted(results, key=lambda item: item[0])


def _ranked(timer, run, table_bm: int, block_ms, candidates) -> list[tuple[float, dict]]:
    """``[(median µs, config)]``, fastest first, of ``run(BLOCK_M, config)`` (one GEMM launch over an
    alignment of that block size; ``config`` None = the table's lookup): the table's own at ``table_bm``
    first, the baseline in the same run (``{"table": 1}``), then every candidate at each ``BLOCK_M`` of
    ``block_ms``. A candidate the GPU cannot run (shared memory, a compile error) is reported and skipped."""
    results = [(timer(lambda: run(table_bm, None))["median_us"], {"table": 1, "BLOCK_M": table_bm})]
    for bm in block_ms:
        for cfg in candidates:
            try:
                results.append((timer(lambda cfg=cfg, bm=bm: run(bm, cfg))["median_us"], {"BLOCK_M": bm, **cfg}))
            except Exception as exc:  # a config the GPU cannot run: report and go on
                print(f"  skip BLOCK_M={bm} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
    return sorted(results, key=lambda item: item[0])


def sweep_gemm(p, timer, stage, h, candidates=GEMM_CANDIDATES, block_ms=()):
    """Rank ``candidates`` for one base GEMM stage at ``p.M``: the table's entry at the alignment's own
    ``BLOCK_M`` (``configs.base_moe_block_m``) first, as the baseline in the same run (``{"table": 1}``),
    then every candidate at each ``BLOCK_M`` of ``block_ms`` (default: the table's) over an alignment
    of that block size. Returns ``[(median µs, config)]`` sorted, fastest first."""
    M, k = p.M, p.k
    if stage == "gate_up":
        a, w, rows_in, tw = p.x, p.w_gu, k, None
    else:
        a, w, rows_in, tw = h, p.w_d, 1, p.topk_weights
    c = torch.empty(M * k, w.shape[1], dtype=a.dtype, device=a.device)
    kw = {"top_k": k, "num_pairs": M * k, "in_row_div": rows_in, "topk_weights": tw}
    block_ms = block_ms or (p.bm_base,)
    aligns = {bm: p.base_align if bm == p.bm_base else moe_align_block_size(p.topk_ids, p.E, bm)
              for bm in {p.bm_base, *block_ms}}
    return _ranked(timer, lambda bm, cfg: fused_moe_gemm(a, w, c, aligns[bm], config=cfg, **kw), p.bm_base,
                   block_ms, candidates)


def sweep_fp8_gemm(p, timer, stage, h, fp8, candidates=FP8_GEMM_CANDIDATES, block_ms=FP8_BLOCK_MS):
    """Rank ``candidates`` for one w8a8 base GEMM stage at ``p.M`` (``fp8``: ``bench_moe_lora.fp8_base``):
    the table's lookup at the alignment ``fused_moe`` picks for the fp8 base first, as the baseline in
    the same run (``{"table": 1}``), then every candidate at each ``BLOCK_M`` of ``block_ms``. The input
    (x, or h for down) is quantized once, outside the timing. Returns ``[(median µs, config)]``, fastest
    first."""
    from moelora_kernels.configs import base_moe_block_m

    M, k, block = p.M, p.k, fp8["kw"]["weight_block"]
    if stage == "gate_up":
        a, w, sinv, rows_in, tw, half = p.x, fp8["w_gu"], fp8["kw"]["w_gate_up_scale_inv"], k, None, p.I
    else:
        a, w, sinv, rows_in, tw, half = h, fp8["w_d"], fp8["kw"]["w_down_scale_inv"], 1, p.topk_weights, None
    q, s = quantize_activation_fp8(a.reshape(-1, a.shape[-1]), block[1])
    c = torch.empty(M * k, w.shape[1], dtype=a.dtype, device=a.device)
    kw = {"block": block, "top_k": k, "num_pairs": M * k, "in_row_div": rows_in, "half": half, "topk_weights": tw}
    table_bm = base_moe_block_m(M, k, p.E, fp8=True)
    aligns = {bm: moe_align_block_size(p.topk_ids, p.E, bm) for bm in {table_bm, *block_ms}}
    return _ranked(timer, lambda bm, cfg: fp8_moe_gemm(q, s, w, sinv, c, aligns[bm], config=cfg, **kw), table_bm,
                   block_ms, candidates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", default=["fused_moe_lora", "fused_moe_gemm"])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 32, 128, 512])
    parser.add_argument("--ranks", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--replays", type=int, default=None, help="graph replays per unit (20; --variants: 100)")
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--wide", action="store_true",
                        help="fused_moe_lora: also sweep num_warps, num_stages and EXPAND_LOADS (64 candidates); "
                             "fused_moe_gemm: BLOCK_N 128 and 256 and num_stages 3 and 4 (16 candidates)")
    parser.add_argument("--block-m", type=int, nargs="*", default=[],
                        help="fused_moe_gemm: BLOCK_M values of the base alignment to sweep (default: the "
                             "table's, configs.moe_block_m), e.g. 64 128 at M >= 512")
    parser.add_argument("--variants", action="store_true", help="A/B the pair's tiles and the split alignment")
    parser.add_argument("--out-dir", default=".", help="--variants: where variants.json and log.txt go")
    parser.add_argument("--dry-run", action="store_true", help="--variants on the CPU (interpreter, tiny shapes)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="--variants: stop timing new units after this")
    parser.add_argument("--lora-tokens", type=int, nargs="*", default=[8, 32, 128, 512],
                        help="--variants: M of (b)")
    parser.add_argument("--align-tokens", type=int, nargs="*", default=[128, 512, 2048], help="--variants: M of (c)")
    parser.add_argument("--families", nargs="*", choices=["b", "c"], default=["b", "c"],
                        help="--variants: which to run: (b) the pair's tiles, (c) split alignment")
    args = parser.parse_args()
    if args.variants or args.dry_run:
        from variants import run_variants

        args.replays = args.replays or 100
        return run_variants(args)
    args.replays = args.replays or 20
    shape = MODELS["qwen3-30b-a3b-layer"]
    gen = torch.Generator("cuda").manual_seed(0)
    H, I, E = shape["H"], shape["I"], shape["E"]  # noqa: E741
    base = {"w_gu": (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H**0.5).to(torch.bfloat16),
            "w_d": (torch.randn(E, H, I, generator=gen, device="cuda") / I**0.5).to(torch.bfloat16)}
    timer = Timer(args.replays)
    pools = {R: make_pool(shape, R, gen) for R in args.ranks} if "fused_moe_lora" in args.ops else {}
    if "fp8_moe_gemm" in args.ops:
        from bench_moe_lora import fp8_base

        fp8 = fp8_base(base, I)
    found = []
    for M in args.tokens:
        p = Problem(M, shape, gen, base)
        gate_up, h, down = p.base_buffers()
        for stage in ("gate_up", "down"):
            if "fused_moe_gemm" in args.ops:
                ranked = sweep_gemm(p, timer, stage, h, GEMM_WIDE_CANDIDATES if args.wide else GEMM_CANDIDATES,
                                    tuple(args.block_m))
                table_us = next(us for us, cfg in ranked if cfg.get("table"))
                ranked = [(us, cfg) for us, cfg in ranked if not cfg.get("table")] or [(table_us, {"table": 1})]
                best = ranked[0]
                print(f"fused_moe_gemm {stage:7} M={M:5}: best {best[0]:7.1f} µs {best[1]} "
                      f"(table {table_us:.1f} at BLOCK_M {p.bm_base}, worst {ranked[-1][0]:.1f})", flush=True)
                found.append({"op": "fused_moe_gemm", "stage": stage, "M": M, "us": best[0], **best[1],
                              "table_us": table_us, "table_block_m": p.bm_base,
                              "top5": [{"us": us, **cfg} for us, cfg in ranked[:5]]})
                Path(args.out).write_text(json.dumps(found, indent=2))
            if "fp8_moe_gemm" in args.ops:
                ranked = sweep_fp8_gemm(p, timer, stage, h, fp8, block_ms=tuple(args.block_m) or FP8_BLOCK_MS)
                table = next((us, cfg) for us, cfg in ranked if cfg.get("table"))
                ranked = [(us, cfg) for us, cfg in ranked if not cfg.get("table")] or [table]
                best = ranked[0]
                print(f"fp8_moe_gemm {stage:7} M={M:5}: best {best[0]:7.1f} µs {best[1]} "
                      f"(table {table[0]:.1f} at BLOCK_M {table[1]['BLOCK_M']}, worst {ranked[-1][0]:.1f})", flush=True)
                found.append({"op": "fp8_moe_gemm", "stage": stage, "M": M, "us": best[0], **best[1],
                              "table_us": table[0], "table_block_m": table[1]["BLOCK_M"],
                              "all": [{"us": us, **cfg} for us, cfg in ranked]})
                Path(args.out).write_text(json.dumps(found, indent=2))
            for R, w in pools.items():
                ranked = sweep_lora(p, w, timer, stage, h, gate_up, down,
                                    LORA_WIDE_CANDIDATES if args.wide else LORA_CANDIDATES)
                if ranked:
                    table_us = next(us for us, cfg in ranked if cfg.get("table"))
                    ranked = [(us, cfg) for us, cfg in ranked if not cfg.get("table")] or [(table_us, {"table": 1})]
                    best = ranked[0]
                    print(f"fused_moe_lora {stage:7} M={M:5} R={R:3}: best {best[0]:7.1f} µs {best[1]} "
                          f"(table {table_us:.1f}, worst {ranked[-1][0]:.1f})", flush=True)
                    found.append({"op": "fused_moe_lora", "stage": stage, "M": M, "R": R, "us": best[0], **best[1],
                                  "table_us": table_us, "top5": [{"us": us, **cfg} for us, cfg in ranked[:5]]})
                    Path(args.out).write_text(json.dumps(found, indent=2))
        del p
    Path(args.out).write_text(json.dumps(found, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
