"""The base fused-MoE GEMMs with the MoE-LoRA deltas fused in (``fused_moe_gemm(lora=GemmLoRA(...))``,
``fused_moe(fused_lora=...)``; the ``fused_moe`` capability of DESIGN.md §5) against their twin
(``moelora_reference.fused_moe.fused_moe_gemm(lora=)``) and the fp64 oracle
(``moelora_reference.oracle.moe_lora_forward``).

The fused path runs on the base alignment (blocks by expert), so one block holds rows of several
slots and of base tokens; each row adds its own slot's delta. Covers: drawn cases (sentinel ids
-1, extra base experts in [E, E_base), mixed ranks, every expert layout, fp32/fp16 on CPU): the
gate_up GEMM per slice and the down GEMM (router-weighted) per pair on NaN-poisoned outputs (rows
of -1 pairs stay NaN); the whole layer against the oracle (fp32) and against the separate-delta
path; base rows bit-identical to the LoRA-disabled run (same alignment, same base K loop: on the
CPU too). Named cases: one block holding three slots, base rows and a sentinel, at every slot
grouping of the shrink/expand tiles; mixed ranks with a disabled slot, a rank-0 module, -1 / E /
E+1 ids; a disabled slot computed exactly as rank 0; pools storing factors once per slot (expert
stride 0); GPT-OSS's interleaved layout with biases against the separate-delta path; launcher
refusals.
"""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close, cpu, launch_guard, poisoned, randn
from moe_lora_testing import cpu_weights, enabled_of, make_pool

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import KernelPreconditionError
from moelora_kernels import (
    FusedLoRAInputs,
    GemmLoRA,
    MoELoRAInputs,
    fused_moe,
    fused_moe_gemm,
    moe_align_block_size,
    moe_block_m,
    moe_lora_align_block_size,
)
from moelora_reference import fused_moe as twin
from moelora_reference.oracle import moe_lora_forward

pytestmark = pytest.mark.interpreter

LORA_CASES = moe_lora_cases(kinds=("extend", "decode", "mixed"), virtual_experts=False, shared_expert_factors=True)
# the fp64 loop oracle cannot follow the gpu profile's sizes
ORACLE_CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def _base_align(topk_ids, E_base, block_m=None):
    """The base layer's alignment (the fused path's: blocks by expert, whatever the slots)."""
    M, k = topk_ids.shape
    with launch_guard():
        return moe_align_block_size(topk_ids, E_base, block_m or moe_block_m(M, k, E_base))


def _fused(c, enabled=None, mapping=None):
    """(align, FusedLoRAInputs) of a materialized case."""
    mapping = c.token_lora_mapping if mapping is None else mapping
    return _base_align(c.topk_ids, c.base.w_gate_up.shape[0]), FusedLoRAInputs(c.lora, mapping, adapter_enabled=enabled)


def _cpu_lora(g: GemmLoRA) -> GemmLoRA:
    return GemmLoRA(*(cpu(t) for t in (g.lora_a, g.lora_b, g.ranks, g.scalings, g.token_lora_mapping,
                                       g.adapter_enabled)), g.max_rank)


def _gemm_pair(stage, s, c, align, fl, inp, w, tw=None, bias=None, config=None):
    """(kernel output, twin output) of one fused GEMM on NaN-poisoned outputs."""
    M, k = c.topk_ids.shape
    in_row_div = k if stage == "gate_up" else 1
    out = poisoned(M * k, w.shape[1], dtype=inp.dtype)
    with launch_guard():
        fused_moe_gemm(inp, w, out, align, top_k=k, num_pairs=M * k, in_row_div=in_row_div, topk_weights=tw,
                       bias=bias, lora=fl.slice(stage, s), config=config)
    want = twin.fused_moe_gemm(cpu(inp), cpu(w), torch.full(tuple(out.shape), float("nan"), dtype=inp.dtype),
                               cpu(align), top_k=k, num_pairs=M * k, in_row_div=in_row_div,
                               topk_weights=cpu(tw), bias=cpu(bias), lora=_cpu_lora(fl.slice(stage, s)))
    return out.cpu(), want


def _here(c):
    E_base = c.base.w_gate_up.shape[0]
    ids = c.topk_ids.cpu().reshape(-1)
    return (ids >= 0) & (ids < E_base)


@given(case=LORA_CASES, s=st.sampled_from([0, 1]))
def test_gate_up_gemm_with_lora_matches_twin_per_pair(case, s):
    c = case.materialize(DEVICE)
    enabled = enabled_of(c.token_lora_mapping, c.spec.max_loras)
    align, fl = _fused(c, enabled)
    inter = c.spec.I
    w = c.base.w_gate_up[:, s * inter:(s + 1) * inter]
    out, want = _gemm_pair("gate_up", s, c, align, fl, c.x, w)
    here = _here(c)
    assert_close(out[here], want[here], dtype=c.x.dtype, what=f"gate_up slice {s} per pair", seed=case.seed)
    assert bool(out[~here].isnan().all()), f"rows of EXPERT_NOT_HERE pairs were written (seed={case.seed})"


@given(case=LORA_CASES)
def test_down_gemm_with_lora_matches_twin_per_pair(case):
    c = case.materialize(DEVICE)
    M, k = c.topk_ids.shape
    gen = torch.Generator().manual_seed(case.seed)
    h = randn(gen, M * k, c.spec.I, dtype=c.x.dtype)
    align, fl = _fused(c, enabled_of(c.token_lora_mapping, c.spec.max_loras))
    out, want = _gemm_pair("down", 0, c, align, fl, h, c.base.w_down, tw=c.topk_weights)
    here = _here(c)
    assert_close(out[here], want[here], dtype=c.x.dtype, what="down per pair", seed=case.seed)
    assert bool(out[~here].isnan().all()), f"rows of EXPERT_NOT_HERE pairs were written (seed={case.seed})"


# an eighth of the profile's examples: the fp64 loop oracle costs ~3 s an example under the
# interpreter (the backend tests check the layer against the oracle too)
@settings(max_examples=max(1, current_profile().max_examples // 8))
@given(case=moe_lora_cases(ORACLE_CAPS, kinds=("extend", "decode", "mixed"), virtual_experts=False,
                           dtype=torch.float32))
def test_layer_with_fused_lora_matches_oracle_and_separate_deltas(case):
    c = case.materialize(DEVICE)
    spec = c.spec
    M, k = c.topk_ids.shape
    _, fl = _fused(c)
    with launch_guard():
        y = fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down, fused_lora=fl)
        lora_align = moe_lora_align_block_size(c.topk_ids, c.token_lora_mapping, spec.E,
                                               moe_block_m(M, k, spec.E, spec.max_loras), spec.max_loras)
        separate = fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down,
                             lora=MoELoRAInputs(c.lora, lora_align))
    want = moe_lora_forward(cpu(c.x), cpu(c.topk_ids), cpu(c.topk_weights), cpu(c.base.w_gate_up),
                            cpu(c.base.w_down), cpu_weights(c.lora), cpu(c.token_lora_mapping))
    assert_close(y, want, dtype=torch.float32, what="fused-LoRA layer vs oracle", seed=case.seed)
    assert_close(y, separate, dtype=torch.float32, what="fused-LoRA layer vs separate deltas", seed=case.seed)


# --- named cases -----------------------------------------------------------------------------------


def _layer(seed, w, M, k, E_base, ids=None, mapping=None, dtype=None, bias=False):
    """(x, ids, mapping, router weights, w_gate_up, w_down, b_gate_up, b_down) of a named problem."""
    spec = w.spec
    dtype = dtype or spec.dtype
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, M, spec.H, dtype=dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E_base, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    if mapping is None:
        mapping = torch.randint(-1, spec.max_loras, (M,), generator=gen, dtype=torch.int32)
    tw = torch.rand(M, k, generator=gen).to(DEVICE)
    w_gu = randn(gen, E_base, 2 * spec.I, spec.H, dtype=dtype, scale=1 / math.sqrt(spec.H))
    w_d = randn(gen, E_base, spec.H, spec.I, dtype=dtype, scale=1 / math.sqrt(spec.I))
    b_gu = randn(gen, E_base, 2 * spec.I, dtype=dtype) if bias else None
    b_d = randn(gen, E_base, spec.H, dtype=dtype) if bias else None
    return x, ids.to(DEVICE), mapping.to(DEVICE), tw, w_gu, w_d, b_gu, b_d


def _run(w, x, ids, mapping, tw, w_gu, w_d, enabled=None, **kw):
    with launch_guard():
        return fused_moe(x, ids, tw, w_gu, w_d, fused_lora=FusedLoRAInputs(w, mapping, adapter_enabled=enabled), **kw)


#: slot 1 lacks down (rank 0 there), slot 2 lacks gate and up
MIXED = {0: {"gate": 16, "up": 8, "down": 12}, 1: {"gate": 4, "up": 16}, 2: {"down": 5}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_block_of_three_slots_base_rows_and_a_sentinel_matches_twin_and_oracle(dtype):
    # 10 tokens, all on expert 0 (one block of 16 rows): slots 0, 1, 2 and base tokens side by side;
    # the second choice is -1 (not here) or E (an extra base expert without LoRA). Every grouping of
    # the slots' shrink/expand tiles (one slot a tile, two, all) gives the twin's rows; base rows
    # are bit-identical to the LoRA-disabled run; the layer matches the oracle.
    w = make_pool(38, dtype=dtype)
    E = w.spec.E
    mapping = torch.tensor([0, 1, 2, -1, 2, 0, -1, 1, 1, 2], dtype=torch.int32)
    ids = torch.tensor([[0, -1 if t % 2 else E] for t in range(10)], dtype=torch.int32)
    x, ids, mapping, tw, w_gu, w_d, _, _ = _layer(38, w, 10, 2, E + 1, ids=ids, mapping=mapping)
    align = _base_align(ids, E + 1, block_m=16)
    assert int(align.num_tokens_post_padded[0]) == 32, "expert 0's ten pairs are not one block"
    fl = FusedLoRAInputs(w, mapping)
    c = SimpleNamespace(topk_ids=ids)  # what the per-pair check reads of a case
    here = (ids.cpu().reshape(-1) >= 0)
    gen = torch.Generator().manual_seed(38)
    h = randn(gen, 20, w.spec.I, dtype=dtype)
    for group in (1, 2, 4):
        cfg = {"LORA_SLOT_GROUP": group}
        out, want = _gemm_pair("gate_up", 1, c, align, fl, x, w_gu[:, w.spec.I:], config=cfg)
        assert_close(out[here], want[here], dtype=dtype, what=f"gate_up (up slice), {group} slots a tile")
        assert bool(out[~here].isnan().all()), "rows of EXPERT_NOT_HERE pairs were written"
        out, want = _gemm_pair("down", 0, c, align, fl, h, w_d, tw=tw, config=cfg)
        assert_close(out[here], want[here], dtype=dtype, what=f"down, {group} slots a tile")
    y = _run(w, x, ids, mapping, tw, w_gu, w_d)
    off = _run(w, x, ids, torch.full_like(mapping, -1), tw, w_gu, w_d)
    want = moe_lora_forward(cpu(x).double(), cpu(ids), cpu(tw).double(), cpu(w_gu).double(), cpu(w_d).double(),
                            cpu_weights(w), cpu(mapping))
    assert_close(y, want, dtype=dtype, what="one block of three slots vs oracle")
    base = (mapping == -1).cpu()
    assert_bitwise_equal(y.cpu()[base], off.cpu()[base], what="base rows beside three slots in one block")
    assert not torch.equal(y.cpu()[~base], off.cpu()[~base]), "adapter rows got no delta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_ranks_disabled_slot_and_sentinel_ids_match_oracle(dtype):
    # slot 1's down has rank 0, slot 2 lacks gate and up; slot 2 is then disabled; ids -1, E, E+1
    w = make_pool(31, dtype=dtype, ranks=MIXED)
    E = w.spec.E
    ids = torch.tensor([[-1, 0], [E, 1], [E + 1, -1], [2, E], [4, 3], [1, 2], [0, 4]] * 6, dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, -1, 1, 2, 0] * 6, dtype=torch.int32)
    x, ids, mapping, tw, w_gu, w_d, _, _ = _layer(31, w, 42, 2, E + 2, ids=ids, mapping=mapping)
    for enabled, live in ((None, mapping), (torch.tensor([1, 1, 0], dtype=torch.int32, device=DEVICE),
                                             torch.where(mapping == 2, -1, mapping))):
        y = _run(w, x, ids, mapping, tw, w_gu, w_d, enabled=enabled)
        want = moe_lora_forward(cpu(x).double(), cpu(ids), cpu(tw).double(), cpu(w_gu).double(), cpu(w_d).double(),
                                cpu_weights(w), cpu(live))
        assert_close(y, want, dtype=dtype, what=f"mixed ranks, enabled={enabled}")


@pytest.mark.parametrize("layout", ["shared_outer", "fully_shared"])
def test_factors_stored_once_per_slot_are_read_with_expert_stride_zero(layout):
    w = make_pool(37, layout=layout)
    assert w.gate_up_A.stride(2) == 0, "the pool does not share its gate_up A across experts"
    x, ids, mapping, tw, w_gu, w_d, _, _ = _layer(37, w, 24, 2, w.spec.E + 1)
    y = _run(w, x, ids, mapping, tw, w_gu, w_d)
    want = moe_lora_forward(cpu(x), cpu(ids), cpu(tw), cpu(w_gu), cpu(w_d), cpu_weights(w), cpu(mapping))
    assert_close(y, want, dtype=torch.float32, what=f"{layout} pool vs oracle")


def test_disabled_slot_is_computed_exactly_as_rank_zero():
    # a disabled slot's rows keep the base sum: bit-identical to the same pool with its ranks 0
    w = make_pool(32)
    mapping = torch.tensor([0, 1, 1, 2, -1, 1, 0, 2] * 2, dtype=torch.int32)
    x, ids, mapping, tw, w_gu, w_d, _, _ = _layer(32, w, 16, 2, w.spec.E, mapping=mapping)
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    y = _run(w, x, ids, mapping, tw, w_gu, w_d, enabled=enabled)
    live = _run(w, x, ids, mapping, tw, w_gu, w_d)
    w.module_ranks[:, 1] = 0
    y0 = _run(w, x, ids, mapping, tw, w_gu, w_d)
    rows = (mapping == 1).cpu()
    assert_bitwise_equal(y.cpu()[rows], y0.cpu()[rows], what="disabled slot rows vs rank 0")
    assert not torch.equal(y.cpu()[rows], live.cpu()[rows]), "slot 1 enabled adds no delta: the case tests nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_base_rows_bit_identical_to_the_lora_disabled_run(dtype):
    # NO_ADAPTER tokens on experts 0-1 only, adapter tokens on 2-4 (the drawn test below mixes them)
    w = make_pool(33, dtype=dtype)
    M, k = 40, 2
    gen = torch.Generator().manual_seed(33)
    mapping = torch.tensor([-1, 0, 1, 2] * 10, dtype=torch.int32)
    ids = torch.stack([torch.randperm(2, generator=gen) if s < 0 else 2 + torch.randperm(3, generator=gen)[:k]
                       for s in mapping.tolist()]).to(torch.int32)
    x, ids, mapping, tw, w_gu, w_d, _, _ = _layer(33, w, M, k, w.spec.E, ids=ids, mapping=mapping)
    y = _run(w, x, ids, mapping, tw, w_gu, w_d)
    off = _run(w, x, ids, torch.full_like(mapping, -1), tw, w_gu, w_d)
    base = (mapping == -1).cpu()
    assert_bitwise_equal(y.cpu()[base], off.cpu()[base], what="base rows vs the LoRA-disabled run")
    assert not torch.equal(y.cpu()[~base], off.cpu()[~base]), "adapter rows got no delta"


@given(case=LORA_CASES)
def test_drawn_base_rows_bit_identical_to_the_lora_disabled_run(case):
    c = case.materialize(DEVICE)
    _, fl = _fused(c)
    _, off = _fused(c, mapping=torch.full_like(c.token_lora_mapping, -1))
    with launch_guard():
        y = fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down, fused_lora=fl)
        y0 = fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down, fused_lora=off)
    base = (c.token_lora_mapping < 0).cpu()
    assert_bitwise_equal(y.cpu()[base], y0.cpu()[base], what="base rows vs the LoRA-disabled run", seed=case.seed)


def test_interleaved_layout_with_biases_matches_separate_deltas():
    # GPT-OSS: gate 0::2, up 1::2 of w_gate_up's rows, of the bias and of gate_up_out (strided views)
    w = make_pool(34, ranks=MIXED)
    x, ids, mapping, tw, w_gu, w_d, b_gu, b_d = _layer(34, w, 37, 2, w.spec.E, bias=True)
    kw = dict(b_gate_up=b_gu, b_down=b_d, layout="interleaved", activation="swiglu_oai")
    y = _run(w, x, ids, mapping, tw, w_gu, w_d, **kw)
    spec = w.spec
    with launch_guard():
        lora_align = moe_lora_align_block_size(ids, mapping, spec.E, 32, spec.max_loras)
        want = fused_moe(x, ids, tw, w_gu, w_d, lora=MoELoRAInputs(w, lora_align, layout="interleaved"), **kw)
    assert_close(y, want, dtype=torch.float32, what="interleaved + biases vs separate deltas")


def _bad_gemm(**override):
    """One gate-slice fused GEMM call with ``override`` applied (a callable gets the valid GemmLoRA)."""
    w = make_pool(35)
    spec = w.spec
    x, ids, mapping, _, w_gu, _, _, _ = _layer(35, w, 8, 2, spec.E)
    align = _base_align(ids, spec.E)
    lora = FusedLoRAInputs(w, mapping).slice("gate_up", 0)
    args = dict(a=x, w=w_gu[:, :spec.I], c=torch.empty(16, spec.I, device=DEVICE), align=align, top_k=2,
                num_pairs=16, in_row_div=2, lora=lora)
    args.update({key: value(lora) if callable(value) else value for key, value in override.items()})
    fused_moe_gemm(**args)


@pytest.mark.parametrize("override, match", [
    (dict(scale=lambda lo: torch.ones(5, device=DEVICE)), "scale"),
    (dict(add_into=True), "add_into"),
    (dict(lora=lambda lo: replace(lo, max_rank=17)), "max_rank"),
    (dict(lora=lambda lo: replace(lo, lora_a=lo.lora_a[..., :8])), "K"),
    (dict(lora=lambda lo: replace(lo, lora_b=lo.lora_b[:, :, :4])), "lora_b"),
    (dict(lora=lambda lo: replace(lo, ranks=lo.ranks.float())), "ranks"),
    (dict(lora=lambda lo: replace(lo, token_lora_mapping=lo.token_lora_mapping[:7])), "token_lora_mapping"),
    (dict(lora=lambda lo: replace(lo, token_lora_mapping=lo.token_lora_mapping.long())), "token_lora_mapping"),
    (dict(config={"LORA_SLOT_GROUP": 3}), "LORA_SLOT_GROUP"),
    (dict(lora=lambda lo: "not a GemmLoRA"), "GemmLoRA"),
])
def test_fused_gemm_refuses_bad_lora_arguments(override, match):
    with pytest.raises(KernelPreconditionError, match=match):
        _bad_gemm(**override)


def test_fused_moe_refuses_fused_lora_with_other_deltas_or_a_bad_mapping():
    w = make_pool(36)
    spec = w.spec
    x, ids, mapping, tw, w_gu, w_d, _, _ = _layer(36, w, 8, 2, spec.E)
    fl = FusedLoRAInputs(w, mapping)
    lora_align = moe_lora_align_block_size(ids, mapping, spec.E, 16, spec.max_loras)
    with pytest.raises(KernelPreconditionError, match="fused_lora"):
        fused_moe(x, ids, tw, w_gu, w_d, fused_lora=fl, deltas=MoELoRAInputs(w, lora_align))
    with pytest.raises(KernelPreconditionError, match="token_lora_mapping"):
        fused_moe(x, ids, tw, w_gu, w_d, fused_lora=FusedLoRAInputs(w, mapping[:5]))
    with pytest.raises(KernelPreconditionError, match="gated"):
        fused_moe(x, ids, tw, w_gu[:, :spec.I], w_d, fused_lora=fl, gated=False)
    with pytest.raises(KernelPreconditionError, match="max_rank"):
        fused_moe(x, ids, tw, w_gu, w_d, fused_lora=FusedLoRAInputs(w, mapping, max_rank=8))
