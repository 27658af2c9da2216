"""MoE multi-LoRA kernel benchmark on one GPU, by the method of benchmarks/README.md.

Shapes: Qwen3-30B-A3B MoE layer (H 2048, I 768, E 128, top-8, bf16); max_loras 4, every slot loaded
at rank R in {16, 64}; M in {1, 8, 32, 128, 512, 2048, 8192} tokens in 5 contiguous requests (slots
0-3 and one base request: 80 % adapter tokens); router logits ~ N(0, 1) → softmax → top-8 distinct,
renormalised; weights ~ N(0, 1/fan-in).

Units, each captured once in a CUDA graph and replayed ``--replays`` times (100) with a 128 MB
memset before every replay (L2 flushed), CUDA events around each replay, median reported:

- (a) base fused MoE: gate_up GEMM, SiLU·up, down GEMM with router weight, top-k sum (alignment
  precomputed);
- (b) the MoE-LoRA deltas: gate_up shrink+expand of both slices and down shrink+expand, added into
  the base buffers — ``moe_lora_delta``'s own choice (the product path), plus the fused kernel, the
  unfused shrink/expand pair and virtual experts forced, as variants; ``b_idle_us``: the auto path
  with every slot disabled (each program leaves at its first check; the base buffers must stay
  bit-identical), i.e. what the launches and grids cost before any row has work;
- (c) ``moe_lora_align_block_size`` (and the base alignment);
- baseline: the reference backend's graph-safe torch deltas; ceilings: a 2 GiB device-to-device
  copy (read + write bytes), plain eager ``copy_`` (``copy_plain``, ~4.3 TB/s on an H200: the
  efficiencies ``b_frac_copy`` are against this one) and, as before, replayed in the timer's graph
  after the L2 flush (``copy``, ~2.7 TB/s: a read-dominated kernel can exceed it).

Before timing, every unit is checked against a torch path (bucketed per (slot, expert) matmuls in
fp32) and the alignment against the contract checker. Prints a table; writes JSON to ``--out``.

    PYTHONPATH=packages/core/src:packages/kernels/src:reference/src python benchmarks/bench_moe_lora.py \\
        --out bench.json [--quick] [--expert-layout shared_outer]

``--expert-layout`` picks the pool's expert layout (``moelora_core.EXPERT_LAYOUTS``): with
"shared_outer" every slot's adapter shares gate_up A and down B by all experts, stored once per slot
and read by the kernels with expert stride 0 (the stride-0 path); "fully_shared" shares all four.
Rows then carry ``expert_layout`` and ``slot_bytes`` (the pool's bytes per slot as stored).

``--base-quant fp8`` adds, per (M, R), the fp8 block-scaled base (DESIGN.md §1; the base weights
quantized at block 128 × 128 by ``moelora_core.fp8_block.quantize_weight_fp8_block``, the Qwen3-FP8 /
DeepSeek-V3 format): ``a_fp8_us`` the w8a8 base fused MoE alone (activation quantization per token per
K-group + the fp8 grouped GEMMs, ``fused_moe(weight_block=...)``), ``ab_fp8_us`` the same layer with the
MoE-LoRA deltas on the unquantized x and h (``deltas=MoELoRAInputs``), ``b_fp8_over_a_fp8`` the LoRA
overhead on it and ``a_fp8_over_a`` the fp8 base against the bf16 one; ``err_a_fp8`` is the fp8 base's
relative error against the bf16 torch path (quantization, a few percent).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for src in ("packages/core/src", "packages/kernels/src", "reference/src"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

import triton  # noqa: E402

from moelora_core import BatchSpec, ForwardMode, LoRALayerSpec, LoRAWeights, ModuleLoRA, Request  # noqa: E402
from moelora_core.align import AlignOutput  # noqa: E402
from moelora_core.layer_spec import EXPERT_LAYOUTS, expert_factor  # noqa: E402
from moelora_kernels import (  # noqa: E402
    MoELoRAInputs,
    fused_moe,
    moe_align_block_size,
    moe_block_m,
    moe_lora_align_block_size,
    moe_lora_delta,
    stage_tensors,
    token_lora_mapping,
    virtual_align,
    virtual_moe_lora_delta,
)
from moelora_kernels.configs import base_moe_block_m  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_targets  # noqa: E402

#: Named model registry (layer shapes) and regimes.
MODELS = {"qwen3-30b-a3b-layer": {"H": 2048, "I": 768, "E": 128, "top_k": 8}}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
RANKS = (16, 64)
MAX_LORAS = 4
ALIGN_TARGET_US = 15.0
DT = torch.bfloat16
#: Where problems, pools and the torch paths live; a CPU dry run of sweep_configs.py (interpreter,
#: tiny shapes) sets it, and DT, to "cpu" / fp32 before building anything.
DEVICE = "cuda"


def regime(M: int) -> str:
    return f"decode-{M}tok" if M <= 128 else f"prefill-{M}tok"


# --- timing ---------------------------------------------------------------------------------------

class Timer:
    """Capture once, replay N times with an L2 flush (128 MB memset) before each replay."""

    def __init__(self, replays: int):
        self.replays = replays
        self.flush = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, replays: int | None = None) -> dict[str, float]:
        n = replays or self.replays
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile and allocate outside the capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # captured on the warm-up's stream, as engines capture: stream-keyed scratch (SGLang's
        # LoraWorkspace) warmed there is found again during the capture
        with torch.cuda.graph(graph, stream=side):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self.flush.zero_()
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return {"median_us": statistics.median(us), "p10_us": us[len(us) // 10], "p90_us": us[(9 * len(us)) // 10]}


def copy_bandwidth(timer: Timer) -> dict[str, float]:
    """2 GiB device-to-device copy: bytes read + written over the median time."""
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timer(lambda s=src, d=dst: d.copy_(s), replays=20)
    del src, dst
    return {**t, "GBps": 2 * n / (t["median_us"] * 1e-6) / 1e9}


def plain_copy_ceiling() -> dict[str, float]:
    """2 GiB eager ``copy_`` (no graph, no flush): bytes read + written over the median of 20."""
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    del src, dst
    med = statistics.median(times)
    return {"median_us": med, "GBps": 2 * n / (med * 1e-6) / 1e9}


# --- problem ----------------------------------------------------------------------------------------

def request_lengths(M: int) -> tuple[list[int], list[int]]:
    """5 contiguous requests (slots 0-3, then a base request), as even as M allows."""
    slots = [0, 1, 2, 3, -1]
    lens = [M // 5 + (i < M % 5) for i in range(5)]
    return [n for n in lens if n], [s for s, n in zip(slots, lens) if n]


class Problem:
    def __init__(self, M: int, shape: dict, gen: torch.Generator, base: dict):
        H, E, k = shape["H"], shape["E"], shape["top_k"]
        self.M, self.k, self.E, self.H, self.I = M, k, E, H, shape["I"]
        self.lens, self.slots = request_lengths(M)
        self.x = torch.randn(M, H, generator=gen, device=DEVICE).to(DT)
        logits = torch.randn(M, E, generator=gen, device=DEVICE)
        w, ids = torch.topk(torch.softmax(logits, -1), k)
        self.topk_weights = (w / w.sum(-1, keepdim=True)).contiguous()
        self.topk_ids = ids.to(torch.int32).contiguous()
        indptr = [0]
        for n in self.lens:
            indptr.append(indptr[-1] + n)
        self.seg_indptr = torch.tensor(indptr, dtype=torch.int32, device=DEVICE)
        self.req_weight_indices = torch.tensor(self.slots, dtype=torch.int32, device=DEVICE)
        self.mapping, self.enabled = token_lora_mapping(self.seg_indptr, self.req_weight_indices, max_loras=MAX_LORAS,
                                                        num_tokens=M)
        self.w_gu, self.w_d = base["w_gu"], base["w_d"]
        self.bm_base = base_moe_block_m(M, k, E)  # as fused_moe picks it
        self.bm_lora = moe_block_m(M, k, E, MAX_LORAS)
        self.base_align = moe_align_block_size(self.topk_ids, E, self.bm_base)
        self.lora_align = moe_lora_align_block_size(self.topk_ids, self.mapping, E, self.bm_lora, MAX_LORAS,
                                                    self.enabled)
        self.batch = BatchSpec(ForwardMode.EXTEND, [Request(s, n) for s, n in zip(self.slots, self.lens)], MAX_LORAS,
                               (1,) * MAX_LORAS, (1.0,) * MAX_LORAS)

    def base_buffers(self):
        """Base gate_up_out, h and down_out (what the deltas add into), as the one Triton MoE path
        (``fused_moe``) makes them: a :class:`KeepBaseBuffers` in place of the deltas keeps them."""
        keep = KeepBaseBuffers()
        fused_moe(self.x, self.topk_ids, self.topk_weights, self.w_gu, self.w_d, align=self.base_align, deltas=keep)
        return keep.gate_up_out, keep.h, keep.down_out


class KeepBaseBuffers:
    """A ``MoEDeltas`` that adds nothing and keeps copies of the buffers the deltas would add into."""

    def gate_up(self, x, topk_ids, gate_up_out):
        self.gate_up_out = gate_up_out.clone()

    def down(self, h, topk_ids, topk_weights, down_out):
        self.h, self.down_out = h.clone(), down_out.clone()


def make_pool(shape: dict, R: int, gen: torch.Generator, layout: str = "per_expert") -> LoRAWeights:
    H, I, E = shape["H"], shape["I"], shape["E"]  # noqa: E741
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=shape["top_k"], dense_shapes={},
                         max_loras=MAX_LORAS, max_rank=R, dtype=DT, device=DEVICE, expert_layout=layout)
    w = LoRAWeights(spec)
    for slot in range(MAX_LORAS):
        adapter = {}
        for m in ("gate", "up", "down"):
            fin, fout = spec.module_shape(m)
            ea = 1 if expert_factor(m, "A") in spec.shared_factors else E
            eb = 1 if expert_factor(m, "B") in spec.shared_factors else E
            A = torch.randn(ea, R, fin, generator=gen, device=DEVICE) / math.sqrt(fin)
            B = torch.randn(eb, fout, R, generator=gen, device=DEVICE) / math.sqrt(R)
            adapter[m] = ModuleLoRA(A, B, 2.0 / (1 + slot))
        w.load_slot(slot, adapter)
    return w


# --- torch paths for the correctness checks ----------------------------------------------------------

def torch_base(p: Problem) -> torch.Tensor:
    """The base MoE by expert buckets in fp32, rounded where the kernels round."""
    M, k = p.M, p.k
    ids = p.topk_ids.reshape(-1).long()
    gate_up = torch.zeros(M * k, 2 * p.I, device=DEVICE)
    down = torch.zeros(M * k, p.H, device=DEVICE)
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        gate_up[rows] = (p.x[rows // k].float() @ p.w_gu[e].float().T).to(DT).float()
    g, u = gate_up[:, :p.I], gate_up[:, p.I:]
    h = (g * torch.sigmoid(g) * u).to(DT).float()
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        down[rows] = (h[rows] @ p.w_d[e].float().T * p.topk_weights.reshape(-1)[rows, None]).to(DT).float()
    return down.view(M, k, p.H).sum(1)


def torch_delta(p: Problem, w: LoRAWeights, stage: str, inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out + σ·w·B(A in) by (slot, expert) buckets in fp32, t rounded to bf16 like the kernels."""
    M, k = p.M, p.k
    t = stage_tensors(w, stage)
    A = t["lora_a"] if stage == "gate_up" else t["lora_a"][None]
    B = t["lora_b"] if stage == "gate_up" else t["lora_b"][None]
    sig = t["scalings"] if stage == "gate_up" else t["scalings"][None]
    res = out.reshape(M * k, -1).float().clone()
    N = B.shape[3]
    ids = p.topk_ids.reshape(-1).long()
    slot = p.mapping.long().repeat_interleave(k)
    key = torch.where(slot >= 0, slot * p.E + ids, -1)
    for v in key.unique().tolist():
        if v < 0:
            continue
        s, e = divmod(v, p.E)
        rows = (key == v).nonzero().squeeze(1)
        src = inp[rows // k] if stage == "gate_up" else inp[rows]
        for sl in range(A.shape[0]):
            shrink = (src.float() @ A[sl, s, e].float().T).to(DT).float()
            delta = shrink @ B[sl, s, e].float().T * sig[sl, s]
            if stage == "down":
                delta = delta * p.topk_weights.reshape(-1)[rows, None]
            res[rows, sl * N:(sl + 1) * N] += delta
    return res.to(DT).view_as(out)


#: The bound of each ``err_*`` the rows record (max error relative to the largest |expected|): the bf16 paths
#: against their fp32 references, and the w8a8 base against the bf16 one (a quantization step, not a
#: rounding: DESIGN.md §1); written into the JSON (``error_bounds``) so a reader judges each by its own.
ERROR_BOUNDS = {"default": 2e-2, "err_a_fp8": 1e-1}


def close(actual, expected, what, tol=ERROR_BOUNDS["default"]):
    a, e = actual.float(), expected.float()
    err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)
    ok = err <= tol and bool(torch.isfinite(a).all())
    if not ok:
        raise AssertionError(f"correctness check failed: {what}: max rel err {err:.3e} (bound {tol})")
    return err


def lora_weight_bytes(p: Problem, R: int, shared: frozenset = frozenset()) -> int:
    """Bytes of the LoRA factors the batch needs, each read once: the (slot, expert) pairs hit (a factor of
    ``shared`` once per slot hit), bf16. The floor of any kernel that reads the adapters from HBM, the
    deltas inside the base GEMMs included (they remove the activation and output traffic, not this)."""
    H, I = p.H, p.I  # noqa: E741
    slot = p.mapping.long().repeat_interleave(p.k)
    ids = p.topk_ids.reshape(-1).long()
    hit = slot >= 0
    pairs_hit = int(torch.unique(slot[hit] * p.E + ids[hit]).numel())
    slots_hit = int(torch.unique(slot[hit]).numel())
    sizes = {"gate_up_A": 2 * R * H, "gate_up_B": 2 * I * R, "down_A": R * I, "down_B": H * R}
    return sum((slots_hit if f in shared else pairs_hit) * n for f, n in sizes.items()) * 2


def min_bytes_lora(p: Problem, R: int, shared: frozenset = frozenset()) -> int:
    """Bytes the LoRA deltas must move as a pass of their own: :func:`lora_weight_bytes`, activations in,
    read + write of the touched output rows, router weights."""
    H, I = p.H, p.I  # noqa: E741
    adapter_tokens = int((p.mapping >= 0).sum())
    adapter_pairs = adapter_tokens * p.k
    el = 2  # bf16
    acts = adapter_tokens * H * el + adapter_pairs * I * el + adapter_pairs * 4
    outs = adapter_pairs * (2 * I + H) * el * 2
    return lora_weight_bytes(p, R, shared) + acts + outs


# --- main -----------------------------------------------------------------------------------------------

#: The block of the fp8 base (Qwen3-FP8 / DeepSeek-V3 checkpoints).
FP8_BLOCK = (128, 128)


def fp8_base(base: dict, inter: int) -> dict:
    """The bf16 base weights quantized to fp8 block-scaled (gate's and up's own grids, as checkpoints hold
    them): ``fused_moe``'s fp8 keyword arguments."""
    from moelora_core.fp8_block import quantize_weight_fp8_block

    qg, sg = quantize_weight_fp8_block(base["w_gu"][:, :inter], FP8_BLOCK)
    qu, su = quantize_weight_fp8_block(base["w_gu"][:, inter:], FP8_BLOCK)
    qd, sd = quantize_weight_fp8_block(base["w_d"], FP8_BLOCK)
    return {"w_gu": torch.cat([qg, qu], 1).contiguous(), "w_d": qd.contiguous(),
            "kw": {"weight_block": FP8_BLOCK, "w_gate_up_scale_inv": torch.cat([sg, su], 1).contiguous(),
                   "w_down_scale_inv": sd.contiguous()}}


def fp8_paths(row: dict, p: Problem, w: LoRAWeights, timer: Timer, fp8: dict) -> None:
    """``--base-quant fp8``: the w8a8 base alone and with the MoE-LoRA deltas (module docstring), into ``row``."""
    deltas = MoELoRAInputs(w, p.lora_align, adapter_enabled=p.enabled)
    align = moe_align_block_size(p.topk_ids, p.E, base_moe_block_m(p.M, p.k, p.E, fp8=True))  # as fused_moe picks it

    def base_only(p=p):
        return fused_moe(p.x, p.topk_ids, p.topk_weights, fp8["w_gu"], fp8["w_d"], align=align, **fp8["kw"])

    def with_lora(p=p):
        return fused_moe(p.x, p.topk_ids, p.topk_weights, fp8["w_gu"], fp8["w_d"], align=align,
                         deltas=deltas, **fp8["kw"])

    row["err_a_fp8"] = close(base_only(), torch_base(p), f"fp8 base M={p.M}", tol=ERROR_BOUNDS["err_a_fp8"])
    row["a_fp8_us"] = timer(base_only)["median_us"]
    row["ab_fp8_us"] = timer(with_lora)["median_us"]
    row["a_fp8_over_a"] = row["a_fp8_us"] / row["a_us"]
    row["b_fp8_over_a_fp8"] = (row["ab_fp8_us"] - row["a_fp8_us"]) / row["a_fp8_us"]
    print(f"  M={p.M} R={w.spec.R}: fp8 base {row['a_fp8_us']:.1f} µs ({row['a_fp8_over_a']:.2f}x bf16), with LoRA "
          f"{row['ab_fp8_us']:.1f} µs (+{100 * row['b_fp8_over_a_fp8']:.0f} %)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--model", default="qwen3-30b-a3b-layer", choices=sorted(MODELS))
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--ranks", type=int, nargs="*", default=list(RANKS))
    parser.add_argument("--quick", action="store_true", help="M in {1, 128, 2048}, 20 replays (a smoke run)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the reference backend's torch path")
    parser.add_argument("--expert-layout", default="per_expert", choices=sorted(EXPERT_LAYOUTS),
                        help="the pool's expert layout (shared_outer: the stride-0 path)")
    parser.add_argument("--base-quant", default="none", choices=["none", "fp8"],
                        help="also time the fp8 block-scaled (w8a8) base and the LoRA overhead on it")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.replays = [1, 128, 2048], 20
    if not torch.cuda.is_available():
        sys.exit("bench_moe_lora: needs a CUDA device")
    t0 = time.time()
    # the "b tgt" column and target_* fields: this card's targets file, none for a card without one
    found = check_targets.for_card(torch.cuda.get_device_name(0))
    targets_file, card_targets = (found[0].name, found[1]) if found else (None, None)
    shape = MODELS[args.model]
    gen = torch.Generator("cuda").manual_seed(0)
    timer = Timer(args.replays)
    H, I, E = shape["H"], shape["I"], shape["E"]  # noqa: E741
    base = {"w_gu": (torch.randn(E, 2 * I, H, generator=gen, device="cuda") / math.sqrt(H)).to(DT),
            "w_d": (torch.randn(E, H, I, generator=gen, device="cuda") / math.sqrt(I)).to(DT)}
    fp8 = fp8_base(base, I) if args.base_quant == "fp8" else None
    copy = copy_bandwidth(timer)
    copy_plain = plain_copy_ceiling()
    pools = {R: make_pool(shape, R, gen, args.expert_layout) for R in args.ranks}
    try:
        from moelora_reference.backend import make_backend
    except ImportError:
        make_backend = None
    rows = []
    for M in args.tokens:
        p = Problem(M, shape, gen, base)
        # (a) base fused MoE, checked against the torch path
        y = fused_moe(p.x, p.topk_ids, p.topk_weights, p.w_gu, p.w_d, align=p.base_align)
        err_a = close(y, torch_base(p), f"base M={M}")
        t_a = timer(lambda p=p: fused_moe(p.x, p.topk_ids, p.topk_weights, p.w_gu, p.w_d, align=p.base_align))
        # (c) alignments
        lora_out = AlignOutput(*(t.clone() for t in p.lora_align))
        base_out = AlignOutput(*(t.clone() for t in p.base_align))
        if M <= 512:
            from moelora_reference.align import check_alignment
            check_alignment(AlignOutput(*(t.cpu() for t in lora_out)), p.topk_ids.cpu(), p.mapping.cpu(), E,
                            p.bm_lora, MAX_LORAS, p.enabled.cpu())
        t_c = timer(lambda p=p, o=lora_out: moe_lora_align_block_size(p.topk_ids, p.mapping, E, p.bm_lora, MAX_LORAS,
                                                                      p.enabled, out=o))
        t_cb = timer(lambda p=p, o=base_out: moe_align_block_size(p.topk_ids, E, p.bm_base, out=o))
        gate_up0, h, down0 = p.base_buffers()
        _, valign = virtual_align(p.topk_ids, p.mapping, E, MAX_LORAS)
        for R in args.ranks:
            w = pools[R]
            want_gu = torch_delta(p, w, "gate_up", p.x, gate_up0)
            want_d = torch_delta(p, w, "down", h, down0)
            variants = {
                "auto": lambda gu, d, w=w, p=p, h=h: (
                    moe_lora_delta("gate_up", p.x, gu, w, p.lora_align, top_k=p.k, adapter_enabled=p.enabled),
                    moe_lora_delta("down", h, d, w, p.lora_align, top_k=p.k, topk_weights=p.topk_weights,
                                   adapter_enabled=p.enabled)),
                "fused": lambda gu, d, w=w, p=p, h=h: (
                    moe_lora_delta("gate_up", p.x, gu, w, p.lora_align, top_k=p.k, adapter_enabled=p.enabled,
                                   fused=True),
                    moe_lora_delta("down", h, d, w, p.lora_align, top_k=p.k, topk_weights=p.topk_weights,
                                   adapter_enabled=p.enabled, fused=True)),
                "unfused": lambda gu, d, w=w, p=p, h=h: (
                    moe_lora_delta("gate_up", p.x, gu, w, p.lora_align, top_k=p.k, adapter_enabled=p.enabled,
                                   fused=False),
                    moe_lora_delta("down", h, d, w, p.lora_align, top_k=p.k, topk_weights=p.topk_weights,
                                   adapter_enabled=p.enabled, fused=False)),
                "virtual": lambda gu, d, w=w, p=p, h=h, valign=valign: (
                    virtual_moe_lora_delta("gate_up", p.x, gu, w, valign, top_k=p.k),
                    virtual_moe_lora_delta("down", h, d, w, valign, top_k=p.k, topk_weights=p.topk_weights)),
            }
            backend = None
            if make_backend is not None and not args.no_baseline:
                backend = make_backend(w.spec)
                info = backend.prepare(p.batch)
                variants["reference"] = lambda gu, d, w=w, p=p, h=h, info=info, b=backend: (
                    b.moe_gate_up_delta(p.x, p.topk_ids, gu, w, info),
                    b.moe_down_delta(h, p.topk_ids, p.topk_weights, d, w, info))
            row = {"model": args.model, "regime": regime(M), "M": M, "R": R, "expert_layout": args.expert_layout,
                   "slot_bytes": w.slot_bytes(), "block_m_lora": p.bm_lora,
                   "block_m_base": p.bm_base, "a_us": t_a["median_us"], "a_p10_us": t_a["p10_us"],
                   "a_p90_us": t_a["p90_us"], "c_us": t_c["median_us"], "c_base_us": t_cb["median_us"],
                   "err_a": err_a}
            for name, fn in variants.items():
                gu, d = gate_up0.clone(), down0.clone()
                fn(gu, d)
                row[f"err_{name}"] = max(close(gu, want_gu, f"{name} gate_up M={M} R={R}"),
                                         close(d, want_d, f"{name} down M={M} R={R}"))
                gu, d = gate_up0.clone(), down0.clone()
                reps = args.replays if name != "reference" else max(5, args.replays // 5)
                t = timer(lambda fn=fn, gu=gu, d=d: fn(gu, d), replays=reps)
                row[f"b_{name}_us"] = t["median_us"]
                if name == "auto":
                    row["b_p10_us"], row["b_p90_us"] = t["p10_us"], t["p90_us"]
            # idle: the auto path with every slot disabled, so each program leaves at its first
            # check; what the grids and launches cost a batch with no adapter row (the outputs must
            # stay the base buffers bit for bit)
            idle = torch.zeros_like(p.enabled)
            gu, d = gate_up0.clone(), down0.clone()
            idle_fn = (lambda gu, d, w=w, p=p, h=h, idle=idle: (
                moe_lora_delta("gate_up", p.x, gu, w, p.lora_align, top_k=p.k, adapter_enabled=idle),
                moe_lora_delta("down", h, d, w, p.lora_align, top_k=p.k, topk_weights=p.topk_weights,
                               adapter_enabled=idle)))
            idle_fn(gu, d)
            if not (torch.equal(gu, gate_up0) and torch.equal(d, down0)):
                raise AssertionError(f"idle M={M} R={R}: a disabled slot changed the base outputs")
            row["b_idle_us"] = timer(lambda gu=gu, d=d, f=idle_fn: f(gu, d))["median_us"]
            if fp8 is not None:
                fp8_paths(row, p, w, timer, fp8)
            row["b_us"] = row["b_auto_us"]
            row["b_over_a"] = row["b_us"] / row["a_us"]
            row["b_min_bytes"] = min_bytes_lora(p, R, w.spec.shared_factors)
            row["b_weight_bytes"] = lora_weight_bytes(p, R, w.spec.shared_factors)
            row["b_GBps"] = row["b_min_bytes"] / (row["b_us"] * 1e-6) / 1e9
            row["b_frac_copy"] = row["b_GBps"] / copy_plain["GBps"]
            row["b_frac_copy_in_graph"] = row["b_GBps"] / copy["GBps"]
            row["target_a_us"], row["target_b_us"] = check_targets.cell_targets(card_targets, M, R)
            rows.append(row)
            print(f"  M={M} R={R}: a {row['a_us']:.1f} µs, b {row['b_us']:.1f} µs (fused {row['b_fused_us']:.1f}, "
                  f"unfused {row['b_unfused_us']:.1f}, virtual {row['b_virtual_us']:.1f}, "
                  f"idle {row['b_idle_us']:.1f}), "
                  f"c {row['c_us']:.1f} µs",
                  flush=True)
            del backend
        del p
        torch.cuda.empty_cache()

    header = (f"{'regime':>16} {'R':>3} {'a µs':>8} {'b µs':>8} {'b tgt':>6} {'fused':>8} {'unfused':>8} "
              f"{'virtual':>8} {'ref':>9} {'c µs':>6} {'c base':>6} {'b/a':>5} {'b GB/s':>7} {'%copy':>6}")
    print(f"\n{args.model} bf16, L={MAX_LORAS}, expert layout {args.expert_layout}, {args.replays} graph replays, "
          f"L2 flushed; %copy against a plain copy_ of 2 GiB: {copy_plain['GBps']:.0f} GB/s (in the timer's graph "
          f"after the flush: {copy['GBps']:.0f}); targets: {targets_file or 'none for this card'}")
    print(header)
    for r in rows:
        ref = f"{r['b_reference_us']:9.1f}" if "b_reference_us" in r else f"{'-':>9}"
        print(f"{r['regime']:>16} {r['R']:>3} {r['a_us']:8.1f} {r['b_us']:8.1f} {r['target_b_us'] or '-':>6} "
              f"{r['b_fused_us']:8.1f} {r['b_unfused_us']:8.1f} {r['b_virtual_us']:8.1f} {ref} {r['c_us']:6.1f} "
              f"{r['c_base_us']:6.1f} "
              f"{r['b_over_a']:5.2f} {r['b_GBps']:7.0f} {100 * r['b_frac_copy']:5.1f}%")
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": str(torch.version.cuda),
        "triton": triton.__version__, "python": platform.python_version(), "replays": args.replays,
        "copy": copy, "copy_plain": copy_plain, "align_target_us": ALIGN_TARGET_US, "rows": rows,
        "error_bounds": ERROR_BOUNDS, "targets": targets_file,
        "wall_s": round(time.time() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out} ({record['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
