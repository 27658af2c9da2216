"""moelora's MoE-LoRA deltas side by side with SGLang 0.5.23's and vLLM 0.34.0's released paths, by
the method of benchmarks/README.md (one process, one card, one input set per (M, R)).

Shapes, inputs and timing are ``bench_moe_lora.py``'s (its helpers, imported): Qwen3-30B-A3B layer
(H 2048, I 768, E 128, top-8, bf16), 4 slots loaded at rank R ∈ {16, 64}, M ∈ {1, 8, 32, 128, 512,
2048, 8192} tokens in 5 contiguous requests (slots 0-3 and a base request: 80 % adapter tokens);
each unit captured once in a CUDA graph, replayed ``--replays`` times after an L2 flush, median.
Per (M, R) and path:

- ``b_us``: both stages' deltas (gate_up before the activation, router-weighted down) added into
  the base buffers, the layer's alignment computed beforehand; ``c_us``: the path's per-layer
  alignment alone (vLLM aligns inside its w13 stage and the virtual-experts path routes inside its
  first stage: for those ``c_us`` is None and ``b_us`` includes it, :data:`ALIGN_IN_B`);
- ``err``: the max relative error of both stages against the one fp32 torch path
  (``bench_moe_lora.torch_delta``) on the same inputs, checked before timing;
- ``config``: where the path's kernel configs come from (its tuned table or "default config").

Paths: moelora's shipped product path (``moe_lora_delta``'s own choice, ``moe_lora_align_block_size``),
and every peer path through the same ``moelora_peers`` backends the conformance grid runs (a graph
family prepared at the problem's size, as a captured engine step prepares it).

The base fused MoE, per M (rows with ``R`` None, ``unit`` "base"): moelora's ``fused_moe`` against
SGLang 0.5.23's ``fused_moe_triton`` kernel sequence (``moelora_peers.sglang_base_moe``: its
``invoke_fused_moe_kernel`` / ``act_and_mul_triton`` / ``moe_sum_reduce_triton`` with the config
``try_get_optimal_moe_config`` picks; its alignment is ``sgl_kernel``'s where installed, else SGLang's
torch fallback) and vLLM 0.34.0's ``fused_moe`` where it imports through the
stubs (otherwise a row with ``skipped`` quoting the import error). ``a_us``: gate_up GEMM, SiLU·up,
down GEMM with the router weight, top-k sum, the alignment precomputed; ``c_us``: that alignment
alone; ``err``: against ``bench_moe_lora.torch_base`` (fp32, rounded where the kernels round) on the
same inputs, checked before timing; ``config``: the config file each loaded (moelora: its card table;
SGLang: the file its lookup logged) or "default config"; ``a_over_moelora``.

    PYTHONPATH=<the src folders>:.gpu/peers/site MOELORA_PEERS_ROOT=.gpu/peers/root \\
        python benchmarks/bench_peers.py --out benchmarks/results/<date>-<card>-peers.json
    TRITON_INTERPRET=1 python benchmarks/bench_peers.py --smoke --out /tmp/peers.json   # CPU, tiny shapes

``--smoke`` runs everything on the CPU under the Triton interpreter at a tiny fp16 shape, one call
per unit and wall time (no graph), so the script is tested (packages/peers/tests/test_bench_peers.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for src in ("packages/core/src", "packages/kernels/src", "packages/backends/src", "reference/src",
            "packages/peers/src", "benchmarks"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

import bench_moe_lora as bench  # noqa: E402
import torch  # noqa: E402

from moelora_core.backend import load_backend  # noqa: E402
from moelora_core.backend_checks import GraphCapacity  # noqa: E402

#: peer path → its backend target and where its kernel configs come from.
PEER_PATHS = {
    "sglang:legacy": ("moelora_peers.sglang:legacy", "lora_moe_runners._get_moe_lora_block_config (computed)"),
    "sglang:virtual_experts": ("moelora_peers.sglang:virtual_experts",
                               "virtual_experts._get_stage_config (tuned table for the device, else default)"),
    "sglang:grouped": ("moelora_peers.sglang:grouped", "srt/lora/moe plan tables (resolve_plans for the device)"),
    "vllm:fused": ("moelora_peers.vllm:fused", "default config (get_lora_op_configs, no VLLM_TUNED_CONFIG_FOLDER)"),
}
SMOKE_MODEL = {"H": 32, "I": 16, "E": 4, "top_k": 2}
#: Paths whose per-layer routing runs inside their first stage (virtual experts: the routing cache
#: ``build_lora_hooks`` fills; vLLM: ``add_lora_w13`` aligns): ``b_us`` includes it, ``c_us`` is None.
ALIGN_IN_B = frozenset({"sglang:virtual_experts", "vllm:fused"})


class _WallTimer:
    """The CPU stand-in for ``bench_moe_lora.Timer``: one call, wall time (no graph, no flush)."""

    def __call__(self, fn, replays=None):
        t0 = time.perf_counter()
        fn()
        us = (time.perf_counter() - t0) * 1e6
        return {"median_us": us, "p10_us": us, "p90_us": us}


def moelora_unit(p: bench.Problem, w, h: torch.Tensor):
    """(align, deltas) callables of moelora's product path on problem ``p``."""
    from moelora_kernels import moe_lora_align_block_size, moe_lora_delta

    def align():
        return moe_lora_align_block_size(p.topk_ids, p.mapping, p.E, p.bm_lora, bench.MAX_LORAS, p.enabled)

    def deltas(gu, d, a):
        moe_lora_delta("gate_up", p.x, gu, w, a, top_k=p.k, adapter_enabled=p.enabled)
        moe_lora_delta("down", h, d, w, a, top_k=p.k, topk_weights=p.topk_weights, adapter_enabled=p.enabled)

    return align, deltas, align()


def peer_unit(target: str, p: bench.Problem, w, h: torch.Tensor):
    """(align, deltas, alignment) callables of a peer path's backend on problem ``p``: the prefill
    graph family initialised and prepared at the problem's size (graph-safe metadata, as captured)."""
    backend = load_backend(target)(w.spec)
    backend.init_graph("prefill", GraphCapacity.prefill(p.M, len(p.lens)))
    info = backend.prepare(p.batch, "prefill")
    M, k = p.M, p.k

    def align():
        return backend.moe_align(p.topk_ids, info)

    def deltas(gu, d, a):
        backend.moe_gate_up_delta(p.x, p.topk_ids, gu.view(M, k, -1), w, info, align=a)
        backend.moe_down_delta(h, p.topk_ids, p.topk_weights, d.view(M, k, -1), w, info, align=a)

    return align, deltas, align()


def _why(exc: BaseException, head: int = 300, tail: int = 900) -> str:
    """``Type: message`` of a failed row, its start and its end when long: a Triton ``CompilationError``
    quotes the kernel source first and says what failed last (the first H100 run kept only the source)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= head + tail else f"{text[:head]} … {text[-tail:]}"


#: vLLM's base fused MoE module (imported through the stubs where it can be).
VLLM_FUSED_MOE = "vllm.model_executor.layers.fused_moe.fused_moe"


def moelora_config_source() -> str:
    """The config table moelora's kernels read here (``moelora_kernels.configs``)."""
    from moelora_kernels import configs

    if configs.interpreting():
        return "interpreter config (moelora_kernels.configs.INTERPRETER_CONFIG)"
    path = Path(os.environ.get("MOELORA_KERNEL_CONFIGS") or configs.device_table_path())
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def base_rows(p: bench.Problem, timer, tol: float) -> list[dict]:
    """The base fused MoE of moelora, SGLang and vLLM on problem ``p`` (module docstring), each
    checked against the fp32 torch path before it is timed."""
    from moelora_peers import sglang_base_moe, sglang_modules, vllm_modules

    from moelora_kernels import fused_moe, moe_align_block_size

    want = bench.torch_base(p)
    rows = []

    def moelora():
        return (lambda: moe_align_block_size(p.topk_ids, p.E, p.bm_base),
                lambda a: fused_moe(p.x, p.topk_ids, p.topk_weights, p.w_gu, p.w_d, align=a), moelora_config_source())

    def sglang():
        picked = sglang_base_moe.config(p.w_gu, p.w_d, p.k, p.M)
        bm = picked.config["BLOCK_SIZE_M"]
        source = picked.source + (" (USE_TMA requested, run without TMA)" if picked.tma_requested else "")
        return (lambda: sglang_base_moe.align(p.topk_ids, bm, p.E),
                lambda a: sglang_base_moe.fused_moe(p.x, p.topk_ids, p.topk_weights, p.w_gu, p.w_d, a, picked),
                source)

    for name, make in (("moelora", moelora), ("sglang:fused_moe_triton", sglang)):
        row = {"M": p.M, "R": None, "unit": "base", "regime": bench.regime(p.M), "path": name}
        try:
            align, run, row["config"] = make()
            a = align()
            row["err"] = bench.close(run(a), want, f"{name} base M={p.M}", tol=tol)
            row["a_us"] = timer(lambda run=run, a=a: run(a))["median_us"]
            if name == "moelora" or sglang_modules.native_moe_align_available():
                row["c_us"] = timer(align)["median_us"]
            else:  # its torch fallback syncs on the host: not capturable, and not sgl_kernel's time anyway
                row["c_skipped"] = "no sgl_kernel: SGLang's torch fallback alignment is not timed"
        except Exception as exc:  # a path that cannot run this shape: recorded, not timed
            row["error"] = _why(exc)
        rows.append(row)
    row = {"M": p.M, "R": None, "unit": "base", "regime": bench.regime(p.M), "path": "vllm:fused_moe"}
    try:
        vllm_modules.import_peer(vllm_modules.importer(), VLLM_FUSED_MOE)
        row["skipped"] = "imports through the stubs, but its call is not wired into this benchmark yet"
    except ImportError as exc:  # its module imports the model executor's config classes (not stubbed)
        row["skipped"] = f"{VLLM_FUSED_MOE} does not import through the stubs: {_why(exc)}"
    rows.append(row)
    ref = rows[0]
    for r in rows:
        if "a_us" in r and "a_us" in ref:
            r["a_over_moelora"] = r["a_us"] / ref["a_us"]
    for r in rows:
        # a row can be timed for the kernels and fail in its alignment (then c_us is absent and error says why)
        shown = "; ".join(x for x in (
            f"a {r['a_us']:.1f} µs, err {r['err']:.1e}, {r['config']}" if "a_us" in r else "",
            f"c {r['c_us']:.1f} µs" if "c_us" in r else r.get("c_skipped", ""),
            r.get("error") or r.get("skipped") or "") if x)
        print(f"  M={p.M} base {r['path']}: {shown}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--tokens", type=int, nargs="*", default=list(bench.TOKENS))
    ap.add_argument("--ranks", type=int, nargs="*", default=list(bench.RANKS))
    ap.add_argument("--paths", nargs="*", default=list(PEER_PATHS), choices=list(PEER_PATHS))
    ap.add_argument("--no-base", action="store_true", help="skip the base fused MoE rows")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny fp16 shape, one call per unit")
    args = ap.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("bench_peers --smoke: set TRITON_INTERPRET=1 before Python starts")
        bench.DEVICE, bench.DT = "cpu", torch.float16
        shape, timer, tokens, ranks, tol = SMOKE_MODEL, _WallTimer(), [8], [4], 5e-2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_peers: needs a CUDA device (or --smoke)")
        shape, timer = bench.MODELS["qwen3-30b-a3b-layer"], bench.Timer(args.replays)
        tokens, ranks, tol = args.tokens, args.ranks, 2e-2
    t0 = time.time()
    gen = torch.Generator(bench.DEVICE).manual_seed(0)
    H, I, E = shape["H"], shape["I"], shape["E"]  # noqa: E741
    base = {"w_gu": (torch.randn(E, 2 * I, H, generator=gen, device=bench.DEVICE) / math.sqrt(H)).to(bench.DT),
            "w_d": (torch.randn(E, H, I, generator=gen, device=bench.DEVICE) / math.sqrt(I)).to(bench.DT)}
    pools = {R: bench.make_pool(shape, R, gen) for R in ranks}
    rows = []
    for M in tokens:
        p = bench.Problem(M, shape, gen, base)
        if not args.no_base:
            rows += base_rows(p, timer, tol)
        gate_up0, h, down0 = p.base_buffers()
        for R in ranks:
            w = pools[R]
            want_gu = bench.torch_delta(p, w, "gate_up", p.x, gate_up0)
            want_d = bench.torch_delta(p, w, "down", h, down0)
            units = {"moelora": (moelora_unit, None, "moelora_kernels configs (the card's table)")}
            units.update({name: (peer_unit, target, config) for name, (target, config) in PEER_PATHS.items()
                          if name in args.paths})
            for name, (make, target, config) in units.items():
                row = {"M": M, "R": R, "unit": "lora", "regime": bench.regime(M), "path": name, "config": config}
                try:
                    align, deltas, a = make(p, w, h) if target is None else make(target, p, w, h)
                    gu, d = gate_up0.clone(), down0.clone()
                    deltas(gu, d, a)
                    row["err"] = max(bench.close(gu, want_gu, f"{name} gate_up M={M} R={R}", tol=tol),
                                     bench.close(d, want_d, f"{name} down M={M} R={R}", tol=tol))
                    gu, d = gate_up0.clone(), down0.clone()
                    if name in ALIGN_IN_B:
                        row["b_us"] = timer(lambda gu=gu, d=d, f=deltas, al=align: f(gu, d, al()))["median_us"]
                        row["c_us"] = None
                    else:
                        row["b_us"] = timer(lambda gu=gu, d=d, a=a, f=deltas: f(gu, d, a))["median_us"]
                        row["c_us"] = timer(align)["median_us"]
                except Exception as exc:  # a path that cannot run this shape: recorded, not timed
                    row["error"] = _why(exc)
                rows.append(row)
                shown = (f"b {row['b_us']:.1f} µs, c {row['c_us'] if row['c_us'] is None else round(row['c_us'], 1)}, "
                         f"err {row['err']:.1e}") if "b_us" in row else row["error"]
                print(f"  M={M} R={R} {name}: {shown}", flush=True)
        del p
    for r in rows:
        ref = next((x for x in rows if x["M"] == r["M"] and x["R"] == r["R"] and x["path"] == "moelora"
                    and x["unit"] == r["unit"]), None)
        if ref and "b_us" in r and "b_us" in ref:
            r["b_over_moelora"] = r["b_us"] / ref["b_us"]
    import triton

    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "smoke": args.smoke,
              "gpu": torch.cuda.get_device_name(0) if not args.smoke else "cpu (interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "shape": shape, "dtype": str(bench.DT), "replays": 1 if args.smoke else args.replays,
              "rows": rows, "wall_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out} ({record['wall_s']} s)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
