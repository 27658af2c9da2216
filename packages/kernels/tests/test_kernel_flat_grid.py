"""The MoE-LoRA kernels on the flat block grid (config key ``FLAT_GRID``).

With 1, the shrink, the expand and the fused kernel lay the used blocks of all slots on one grid
axis (program i finds its (block, slot) from the cumulative ``num_tokens_post_padded // BLOCK_M``)
instead of the (per-slot block bound, slot) grid, whose programs mostly leave at once at small M.
The same blocks run either way, so the results are bit-identical (``_moe_lora_kernels`` docstring).

Covers: drawn cases, both stages, the fused kernel and the shrink/expand pair: FLAT_GRID 1 equals
0 bit for bit and the twin within tolerance, rows the delta must not touch keep their bits. Named
cases: a slot count that is not a power of two with an empty slot, a disabled slot holding tokens,
a one-pair slot and two crowded ones; every pair in its own (slot, expert) group, so the used blocks
reach the host bound the flat grid is sized by; a corrupt ``num_tokens_post_padded`` (negative, and
past the capacity on the last slot) runs the same blocks as the (block, slot) grid; invalid values
refused before any write; the shrink and the expand compile for sm_90 with FLAT_GRID 1 (the fused
kernel's compile is in test_kernel_slices_per_program.py).
"""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, H200_MAX_SHARED, assert_bitwise_equal, compile_for_h200, launch_guard, randn
from moe_lora_testing import check_delta, enabled_of, handled, make_pool, named_routing, stage_inputs, twin_delta

from moelora_conformance.strategies import moe_lora_cases
from moelora_core import KernelPreconditionError
from moelora_core.align import AlignOutput
from moelora_kernels import (
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_block_m,
    moe_lora_align_block_size,
    stage_tensors,
)

pytestmark = pytest.mark.interpreter

CASES = moe_lora_cases(kinds=("extend", "decode", "mixed"), virtual_experts=False)
STAGES = ("gate_up", "down")
PATHS = ("fused", "pair")


def run(path, stage, x, out, w, align, k, tw, enabled, flat):
    """One stage's delta on ``path`` with FLAT_GRID ``flat`` (every launch of the path)."""
    t = stage_tensors(w, stage)
    cfg = {"FLAT_GRID": flat}
    with launch_guard():
        if path == "fused":
            fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, stage=stage, top_k=k, ranks=t["ranks"],
                           scalings=t["scalings"], topk_weights=tw, adapter_enabled=enabled, config=cfg)
        else:
            inter = fused_moe_lora_shrink(x, t["lora_a"], align, stage=stage, top_k=k, ranks=t["ranks"],
                                          adapter_enabled=enabled, config=cfg)
            fused_moe_lora_expand(inter, t["lora_b"], align, out, stage=stage, top_k=k, ranks=t["ranks"],
                                  scalings=t["scalings"], topk_weights=tw, adapter_enabled=enabled, config=cfg)
    return out


def check_flat(path, stage, x, out0, w, align, k, tw, enabled, mask, seed, what):
    """FLAT_GRID 1 vs 0 bit for bit, and vs the twin (close where handled, bits elsewhere)."""
    flat = run(path, stage, x, out0.clone(), w, align, k, tw, enabled, 1)
    grid = run(path, stage, x, out0.clone(), w, align, k, tw, enabled, 0)
    assert_bitwise_equal(flat, grid, what=f"{what}: FLAT_GRID 1 vs 0", seed=seed)
    want = twin_delta(stage, x, out0, w, align, k, tw, enabled)
    check_delta(stage, flat, want, out0, mask, x.dtype, seed, f"{what}: FLAT_GRID 1 vs twin")
    return flat


def _inputs(gen, stage, w, M, k):
    tw = torch.rand(M, k, generator=gen).to(DEVICE) if stage == "down" else None
    return stage_inputs(gen, stage, M, k, w.spec.H, w.spec.I, w.spec.dtype, tw)


@given(case=CASES, stage=st.sampled_from(STAGES), path=st.sampled_from(PATHS))
def test_flat_grid_matches_the_block_slot_grid_and_the_twin(case, stage, path):
    c = case.materialize(DEVICE)
    spec, w = c.spec, c.lora
    M, k = c.topk_ids.shape
    gen = torch.Generator().manual_seed(case.seed)
    enabled = enabled_of(c.token_lora_mapping, spec.max_loras)
    with launch_guard():
        align = moe_lora_align_block_size(
            c.topk_ids, c.token_lora_mapping, spec.E, moe_block_m(M, k, spec.E, spec.max_loras), spec.max_loras, enabled
        )
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, c.x.dtype, c.topk_weights)
    mask = handled(stage, c.topk_ids, c.token_lora_mapping, enabled, stage_tensors(w, stage)["ranks"], spec.E)
    check_flat(path, stage, x, out0, w, align, k, tw, enabled, mask, case.seed, f"{path} {stage}")


def _align(ids, mapping, w, enabled, block_m=16):
    with launch_guard():
        return moe_lora_align_block_size(ids, mapping, w.spec.E, block_m, w.spec.max_loras, enabled)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage", STAGES)
def test_uneven_slots_on_five_slots(stage, path):
    # L = 5 (BLOCK_L 8: three masked lanes); slot 0 empty, slot 1 crowded over every expert, slot 2
    # disabled though tokens map to it, slot 3 one token (two blocks), slot 4 crowded; base tokens and ids -1 / E
    w = make_pool(41, L=5, E=6)
    E = w.spec.E
    M, k = 40, 2
    gen = torch.Generator().manual_seed(41)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    ids[3, 0], ids[7, 1] = -1, E
    mapping = torch.tensor([1] * 17 + [2] * 5 + [3] + [4] * 12 + [-1] * 5, dtype=torch.int32)
    enabled = torch.tensor([0, 1, 0, 1, 1], dtype=torch.int32, device=DEVICE)
    gen, ids, mapping = named_routing(41, w.spec, M, k, ids, mapping)
    align = _align(ids, mapping, w, enabled)
    blocks = (align.num_tokens_post_padded.cpu() // 16).tolist()
    assert blocks[0] == blocks[2] == 0 and blocks[3] == 2 and blocks[1] > 2 and blocks[4] > 2, blocks
    x, out0, tw = _inputs(gen, stage, w, M, k)
    mask = handled(stage, ids, mapping, enabled, stage_tensors(w, stage)["ranks"], E)
    out = check_flat(path, stage, x, out0, w, align, k, tw, enabled, mask, 41, f"five slots {path} {stage}")
    assert not torch.equal(out, out0), "the delta added nothing"


@pytest.mark.parametrize("path", PATHS)
def test_every_pair_in_its_own_group_fills_the_flat_bound(path):
    # 15 pairs, each its own (slot, expert) group: 15 used blocks, the host bound
    # num_pairs // BLOCK_M + min(E · L, num_pairs) exactly, so a bound one too small drops a block
    w = make_pool(42, L=3, E=5)
    M, k = 15, 1
    ids = torch.tensor([[e] for e in range(5)] * 3, dtype=torch.int32)
    mapping = torch.tensor([s for s in range(3) for _ in range(5)], dtype=torch.int32)
    gen, ids, mapping = named_routing(42, w.spec, M, k, ids, mapping)
    enabled = enabled_of(mapping, 3)
    align = _align(ids, mapping, w, enabled)
    assert int((align.num_tokens_post_padded // 16).sum()) == 15 == 15 // 16 + min(5 * 3, 15)
    for stage in STAGES:
        x, out0, tw = _inputs(gen, stage, w, M, k)
        mask = handled(stage, ids, mapping, enabled, stage_tensors(w, stage)["ranks"], 5)
        assert bool(mask.all()), "every pair must take a delta"
        check_flat(path, stage, x, out0, w, align, k, tw, enabled, mask, 42, f"own groups {path} {stage}")


@pytest.mark.parametrize("path", PATHS)
def test_a_corrupt_num_tokens_post_padded_runs_the_blocks_of_the_block_slot_grid(path):
    # slot 0 negative (no block in either grid), the last slot past its capacity (both grids stop at
    # the per-slot bound; the blocks past the used ones are expert -1): the same bits either way
    w = make_pool(43, L=3)
    M, k = 24, 2
    gen, ids, mapping = named_routing(43, w.spec, M, k)
    enabled = torch.ones(3, dtype=torch.int32, device=DEVICE)
    align = _align(ids, mapping, w, enabled)
    ntpp = align.num_tokens_post_padded.clone()
    ntpp[0] = -16
    ntpp[2] = align.sorted_token_ids.shape[1] + 10 * 16
    bad = AlignOutput(align.sorted_token_ids, align.expert_ids, ntpp).set_launch(M * k, w.spec.E)
    for stage in STAGES:
        x, out0, tw = _inputs(gen, stage, w, M, k)
        flat = run(path, stage, x, out0.clone(), w, bad, k, tw, enabled, 1)
        grid = run(path, stage, x, out0.clone(), w, bad, k, tw, enabled, 0)
        assert_bitwise_equal(flat, grid, what=f"corrupt counts {path} {stage}: FLAT_GRID 1 vs 0", seed=43)
        assert not torch.equal(flat, out0), "the live slot added nothing"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [2, -1, True, 1.0, "1", None])
def test_an_invalid_flat_grid_is_refused_before_any_write(path, bad):
    w = make_pool(44, L=2, R=8)
    gen, ids, mapping = named_routing(44, w.spec, 6, 2)
    enabled = enabled_of(mapping, 2)
    align = _align(ids, mapping, w, enabled)
    x = randn(gen, 6, w.spec.H, dtype=torch.float32)
    out = randn(gen, 6, 2, 2 * w.spec.I, dtype=torch.float32)
    before = out.clone()
    with pytest.raises(KernelPreconditionError, match=re.escape(f"FLAT_GRID: must be 0 or 1, got {bad!r}")):
        run(path, "gate_up", x, out, w, align, 2, None, enabled, bad)
    assert_bitwise_equal(out, before, what="out after a refused FLAT_GRID")


def _qwen3_args(kernel, R, M=128, L=4, E=128, H=2048, I=768, block_m=16):
    """Runtime arguments of the shrink or the expand for the Qwen3-30B-A3B gate_up stage (bf16)."""
    P = -(-(M * 8 + E * (block_m - 1)) // block_m) * block_m
    meta = {n: "i32" for n in ("sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr",
                               "adapter_enabled_ptr", "ranks_ptr")}
    common = {"rank_bound": R, "num_pairs": M * 8, "num_experts": E, "stride_sorted": P,
              "stride_expert_ids": P // block_m, "stride_rank_s": L, "L": L,
              "slot_blocks_bound": M * 8 // block_m + min(E, M * 8)}
    if kernel == "shrink":
        return meta | common | {
            "x_ptr": "bf16", "a_ptr": "bf16", "inter_ptr": "bf16", "K": H, "R": R, "in_row_div": 8,
            "stride_xm": H, "stride_as": L * E * R * H, "stride_al": E * R * H, "stride_ae": R * H, "stride_ar": H,
            "stride_ik": 0, "stride_is": M * 8 * R, "stride_im": R,
        }
    return meta | common | {
        "inter_ptr": "bf16", "b_ptr": "bf16", "out_ptr": "bf16", "topk_weights_ptr": "fp32", "scalings_ptr": "fp32",
        "N": I, "num_n_tiles": I // 128, "stride_ik": 0, "stride_is": M * 8 * R, "stride_im": R,
        "stride_bs": L * E * I * R, "stride_bl": E * I * R, "stride_be": I * R, "stride_bn": R,
        "stride_om": 2 * I, "stride_os": I, "stride_on": 1, "stride_scaling_s": L,
    }


@pytest.mark.parametrize("kernel", ["shrink", "expand"])
def test_flat_grid_compiles_for_the_h200(kernel):
    # the interpreter runs code the GPU compiler may reject (tl.cumsum's layout, the scalar slot from a
    # reduction): compile both with FLAT_GRID 1 for sm_90 here, so a GPU call does not find out first
    name = {"shrink": "_moe_lora_shrink_kernel", "expand": "_moe_lora_expand_kernel"}[kernel]
    cases = []
    for R in (16, 64):
        consts = {"BLOCK_M": 16, "BLOCK_R": R, "SPLIT_K": 1, "FLAT_GRID": 1, "BLOCK_L": 4, "HAS_ENABLED": True,
                  "DOT_PRECISION": "tf32", "UPCAST": False}
        # (the expand with the exact rank masks of EXPAND_STREAM 0; test_kernel_expand_stream.py compiles the rest)
        consts |= ({"BLOCK_K": 128} if kernel == "shrink"
                   else {"BLOCK_N": 128, "MUL_ROUTED_WEIGHT": False, "RANK_ALIGN": 1})
        cases.append({"args": _qwen3_args(kernel, R), "constexprs": consts, "num_warps": 4, "num_stages": 3})
    results = compile_for_h200(f"moelora_kernels._moe_lora_kernels:{name}", cases)
    for R, r in zip((16, 64), results, strict=True):
        assert "error" not in r, f"{kernel} R={R}: {r.get('error')}"
        assert 0 <= r["shared"] <= H200_MAX_SHARED, f"{kernel} R={R}: shared memory {r['shared']} B"
