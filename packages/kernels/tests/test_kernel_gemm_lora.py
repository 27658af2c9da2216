"""The MoE-LoRA expand in the base GEMM's epilogue (``fused_moe_gemm(lora=GemmLoRA)``,
``MoELoRAInputs(expand_in_gemm=True)``) against its twin (``moelora_reference.fused_moe``), the
separate delta kernels and the fp64 oracle.

Covers: drawn cases for both stages: the GEMM with the expand per pair equal to the twin (same
shrink output) within the dtype's tolerance, rows of -1 pairs never written (NaN-poisoned), every
row the delta must not reach (no adapter, a disabled slot, a rank-0 module, experts in [E, E_base))
bit-identical to the GEMM without LoRA; the whole layer with the expand in the GEMMs against the
fp64 oracle (fp32). Named cases: base tokens bit-identical in a mixed batch (fp32, fp16); a column
tile straddling gate and up (I not a multiple of BLOCK_N); mixed ranks with a module the adapter
lacks and a disabled slot, against the separate kernels; a slot left out only by the alignment (its
rows keep the base); a corrupt device rank read as the host's bound; shared factors (stride-0 experts)
with a rank bound below R; launcher refusals (nothing written), a top_k other than the GEMM's among
them; the sm_90 compile of both stages at R 16 and 64.
"""

import math

import pytest
import torch
from hypothesis import given
from kernel_testing import (
    DEVICE,
    H200_MAX_SHARED,
    assert_bitwise_equal,
    assert_close,
    compile_for_h200,
    launch_guard,
    poisoned,
    randn,
)
from moe_lora_testing import check_layer_against_oracle, handled, make_pool, named_routing

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import KernelPreconditionError
from moelora_kernels import (
    MoELoRAInputs,
    fused_moe,
    fused_moe_gemm,
    moe_align_block_size,
    moe_block_m,
    moe_lora_align_block_size,
    stage_tensors,
)
from moelora_reference import fused_moe as twin

pytestmark = pytest.mark.interpreter

# the twin and the oracle loop in fp64 on the host: neither follows the gpu profile's sizes
ORACLE_CAPS = capped(current_profile().caps, PROFILES["dev"].caps)
LORA_CASES = moe_lora_cases(ORACLE_CAPS, kinds=("extend", "decode", "mixed", "idle"), virtual_experts=False)


def gemm_lora(stage, inp, w, align, ids, mapping, enabled=None, max_rank=None):
    """The stage's shrink (kernel) and its :class:`GemmLoRA`, from ``MoELoRAInputs.gemm_lora`` itself."""
    with launch_guard():
        return MoELoRAInputs(w, align, enabled, max_rank=max_rank, expand_in_gemm=True,
                             token_lora_mapping=mapping).gemm_lora(stage, inp, ids)


def stage_gemm(stage, c_in, w_base, base_align, ids, tw, lora, out):
    """The stage's base GEMM (kernel) into ``out`` [M·k, N], with ``lora`` in its epilogue."""
    M, k = ids.shape
    with launch_guard():
        return fused_moe_gemm(c_in, w_base, out, base_align, top_k=k, num_pairs=M * k,
                              in_row_div=k if stage == "gate_up" else 1, topk_weights=tw, lora=lora)


@pytest.mark.parametrize("stage", ["gate_up", "down"])
@given(case=LORA_CASES)
def test_gemm_with_the_expand_matches_twin_and_leaves_other_rows_alone(stage, case):
    c = case.materialize(DEVICE)
    spec, w = c.spec, c.lora
    M, k = c.topk_ids.shape
    E_base = c.base.w_gate_up.shape[0]
    gen = torch.Generator().manual_seed(case.seed)
    if stage == "gate_up":
        inp, w_base, tw = c.x, c.base.w_gate_up, None
    else:
        inp, w_base, tw = randn(gen, M * k, spec.I, dtype=c.x.dtype), c.base.w_down, c.topk_weights
    with launch_guard():
        base_align = moe_align_block_size(c.topk_ids, E_base, moe_block_m(M, k, E_base))
        align = moe_lora_align_block_size(c.topk_ids, c.token_lora_mapping, spec.E,
                                          moe_block_m(M, k, spec.E, spec.max_loras), spec.max_loras)
    lora = gemm_lora(stage, inp, w, align, c.topk_ids, c.token_lora_mapping)
    N = w_base.shape[1]
    got = stage_gemm(stage, inp, w_base, base_align, c.topk_ids, tw, lora, poisoned(M * k, N, dtype=c.x.dtype))
    plain = stage_gemm(stage, inp, w_base, base_align, c.topk_ids, tw, None, poisoned(M * k, N, dtype=c.x.dtype))
    want = twin.fused_moe_gemm(inp, w_base, torch.full((M * k, N), float("nan"), dtype=c.x.dtype, device=DEVICE),
                               base_align, top_k=k, num_pairs=M * k, in_row_div=k if stage == "gate_up" else 1,
                               topk_weights=tw, lora=lora)
    got, plain, want = got.cpu(), plain.cpu(), want.cpu()
    here = (c.topk_ids >= 0).reshape(-1).cpu()
    assert_close(got[here], want[here], dtype=c.x.dtype, what=f"{stage} GEMM + expand per pair", seed=case.seed)
    assert bool(got[~here].isnan().all()), f"rows of EXPERT_NOT_HERE pairs were written (seed={case.seed})"
    ones = torch.ones(spec.max_loras, dtype=torch.int32)
    reach = handled(stage, c.topk_ids, c.token_lora_mapping, ones, stage_tensors(w, stage)["ranks"], spec.E)
    cols = reach.repeat_interleave(N // reach.shape[0], dim=0).T  # [M·k, N]: where a delta may land
    keep = here[:, None] & ~cols
    assert_bitwise_equal(got[keep], plain[keep], what=f"{stage}: entries without a delta vs the GEMM alone")


@given(case=moe_lora_cases(ORACLE_CAPS, kinds=("extend", "decode", "mixed"), virtual_experts=False,
                           dtype=torch.float32))
def test_layer_with_the_expand_in_the_gemms_matches_oracle(case):
    check_layer_against_oracle(case, "layer, expand in the GEMMs, vs oracle", expand_in_gemm=True)


# --- named cases -----------------------------------------------------------------------------------


def named_layer(seed, w, M, k, mapping=None, enabled=None, dtype=torch.float32, block_m=16):
    """(x, ids, router weights, base weights (E_base = E + 1), base and LoRA alignments, mapping)."""
    spec = w.spec
    gen, ids, mapping = named_routing(seed, spec, M, k, None, mapping)
    E_base = spec.E + 1
    ids = torch.where(torch.arange(M * k, device=DEVICE).reshape(M, k) % 7 == 3, spec.E, ids).to(torch.int32)
    x = randn(gen, M, spec.H, dtype=dtype)
    tw = torch.rand(M, k, generator=gen).to(DEVICE)
    w_gu = randn(gen, E_base, 2 * spec.I, spec.H, dtype=dtype, scale=1 / math.sqrt(spec.H))
    w_d = randn(gen, E_base, spec.H, spec.I, dtype=dtype, scale=1 / math.sqrt(spec.I))
    with launch_guard():
        base_align = moe_align_block_size(ids, E_base, block_m)
        align = moe_lora_align_block_size(ids, mapping, spec.E, block_m, spec.max_loras, enabled)
    return x, ids, tw, w_gu, w_d, base_align, align, mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_base_tokens_bit_identical_in_a_mixed_batch(dtype):
    # the expand rides in the base GEMMs: rows of NO_ADAPTER tokens (and of the expert in [E, E_base))
    # must come out of the same kernels exactly as without LoRA
    w = make_pool(31, dtype=dtype)
    x, ids, tw, w_gu, w_d, base_align, align, mapping = named_layer(31, w, 37, 2, dtype=dtype)
    with launch_guard():
        plain = fused_moe(x, ids, tw, w_gu, w_d, align=base_align)
        sep = fused_moe(x, ids, tw, w_gu, w_d, align=base_align, deltas=MoELoRAInputs(w, align))
        epi = fused_moe(x, ids, tw, w_gu, w_d, align=base_align,
                        deltas=MoELoRAInputs(w, align, expand_in_gemm=True, token_lora_mapping=mapping))
    base_rows = (mapping == -1).cpu()
    assert base_rows.any() and (~base_rows).any()
    assert_bitwise_equal(epi.cpu()[base_rows], plain.cpu()[base_rows], what="base rows")
    assert not torch.equal(epi.cpu()[~base_rows], plain.cpu()[~base_rows])
    assert_close(epi.cpu(), sep.cpu(), dtype=dtype, what="expand in the GEMMs vs the separate deltas", seed=31)


@pytest.mark.parametrize("block_n", [16, 32])
def test_a_column_tile_across_gate_and_up_takes_each_slice_its_own_delta(block_n):
    # I = 24: with BLOCK_N 16 or 32 a tile holds the last gate and the first up columns
    w = make_pool(32, I=24)
    x, ids, _, w_gu, _, base_align, align, mapping = named_layer(32, w, 11, 2)
    M, k = ids.shape
    lora = gemm_lora("gate_up", x, w, align, ids, mapping)
    with launch_guard():
        got = fused_moe_gemm(x, w_gu, poisoned(M * k, 48, dtype=torch.float32), base_align, top_k=k, num_pairs=M * k, in_row_div=k,
                             lora=lora, config={"BLOCK_N": block_n})
    want = twin.fused_moe_gemm(x, w_gu, torch.full((M * k, 48), float("nan"), device=DEVICE), base_align, top_k=k,
                               num_pairs=M * k, in_row_div=k, lora=lora)
    assert_close(got.cpu(), want.cpu(), dtype=torch.float32, what=f"gate_up at BLOCK_N {block_n}", seed=32)


def test_mixed_ranks_a_missing_module_and_a_disabled_slot_match_the_separate_kernels():
    # slot 0: up absent (rank 0), slot 1 disabled, slot 2: rank 5 of R 16
    ranks = {0: {"gate": 16, "down": 8}, 1: {"gate": 16, "up": 16, "down": 16}, 2: {"gate": 5, "up": 5, "down": 5}}
    w = make_pool(33, ranks=ranks)
    mapping = torch.tensor([0, 1, 2, -1, 2, 0, 1, 0, 2, -1, 0, 2, 1], dtype=torch.int32, device=DEVICE)
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    x, ids, tw, w_gu, w_d, base_align, align, mapping = named_layer(33, w, 13, 2, mapping=mapping, enabled=enabled)
    with launch_guard():
        plain = fused_moe(x, ids, tw, w_gu, w_d, align=base_align)
        sep = fused_moe(x, ids, tw, w_gu, w_d, align=base_align, deltas=MoELoRAInputs(w, align, enabled, max_rank=16))
        epi = fused_moe(x, ids, tw, w_gu, w_d, align=base_align,
                        deltas=MoELoRAInputs(w, align, enabled, max_rank=16, expand_in_gemm=True,
                                             token_lora_mapping=mapping))
    assert_close(epi.cpu(), sep.cpu(), dtype=torch.float32, what="mixed ranks, expand in the GEMMs", seed=33)
    off = ((mapping == -1) | (mapping == 1)).cpu()  # no adapter, or a disabled slot
    assert_bitwise_equal(epi.cpu()[off], plain.cpu()[off], what="rows of no adapter and of the disabled slot")
    # slot 0 lacks up: its pairs' up columns of gate_up_out are the base's, bit for bit
    M, k = ids.shape
    lora = gemm_lora("gate_up", x, w, align, ids, mapping, enabled)
    got = fused_moe_gemm(x, w_gu, poisoned(M * k, 48, dtype=torch.float32), base_align, top_k=k, num_pairs=M * k, in_row_div=k, lora=lora)
    base = fused_moe_gemm(x, w_gu, poisoned(M * k, 48, dtype=torch.float32), base_align, top_k=k, num_pairs=M * k, in_row_div=k)
    rows0 = (mapping.repeat_interleave(k) == 0).cpu() & (ids.reshape(-1) < w.spec.E).cpu()
    assert_bitwise_equal(got.cpu()[rows0][:, 24:], base.cpu()[rows0][:, 24:], what="slot 0's up columns")
    assert not torch.equal(got.cpu()[rows0][:, :24], base.cpu()[rows0][:, :24])


def test_a_slot_left_out_only_by_the_alignment_adds_nothing():
    # the alignment skips disabled slot 1, the GEMM is not told (no adapter_enabled): the shrink writes
    # no row of slot 1, and those rows must keep the base, as on the separate path
    w = make_pool(36)
    mapping = torch.tensor([0, 1, 2, -1, 1, 0, 1, 2, 1, -1, 0], dtype=torch.int32, device=DEVICE)
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    x, ids, tw, w_gu, w_d, base_align, align, mapping = named_layer(36, w, 11, 2, mapping=mapping, enabled=enabled)
    with launch_guard():
        plain = fused_moe(x, ids, tw, w_gu, w_d, align=base_align)
        sep = fused_moe(x, ids, tw, w_gu, w_d, align=base_align, deltas=MoELoRAInputs(w, align))
        epi = fused_moe(x, ids, tw, w_gu, w_d, align=base_align,
                        deltas=MoELoRAInputs(w, align, expand_in_gemm=True, token_lora_mapping=mapping))
    off = ((mapping == -1) | (mapping == 1)).cpu()
    assert_bitwise_equal(epi.cpu()[off], plain.cpu()[off], what="rows of no adapter and of the slot left out")
    assert_close(epi.cpu(), sep.cpu(), dtype=torch.float32, what="expand in the GEMMs vs the separate deltas", seed=36)


def test_a_device_rank_above_the_bound_is_read_as_the_bound():
    # a corrupt rank on the device (40 > R = 16): the kernel reads no column past the host's bound
    w = make_pool(37)
    x, ids, _, w_gu, _, base_align, align, mapping = named_layer(37, w, 13, 2)
    M, k = ids.shape
    lora = gemm_lora("gate_up", x, w, align, ids, mapping)
    ranks = lora.ranks.clone()
    ranks[0, 0] = 40
    lora = lora.__class__(lora.intermediate, lora.lora_b, ranks, lora.scalings, lora.token_lora_mapping, k, 16)
    got = fused_moe_gemm(x, w_gu, poisoned(M * k, 48, dtype=torch.float32), base_align, top_k=k, num_pairs=M * k,
                         in_row_div=k, lora=lora)
    want = twin.fused_moe_gemm(x, w_gu, torch.full((M * k, 48), float("nan"), device=DEVICE), base_align, top_k=k,
                               num_pairs=M * k, in_row_div=k, lora=lora)
    assert_close(got.cpu(), want.cpu(), dtype=torch.float32, what="rank 40 read as 16", seed=37)


@pytest.mark.parametrize("layout", ["shared_outer", "fully_shared"])
def test_shared_factors_and_a_rank_bound_below_r_match_the_separate_kernels(layout):
    # stride-0 experts of B (shared_outer shares A only, fully_shared both) and BLOCK_R 16 < R 32
    ranks = {s: {"gate": 16 - 4 * s, "up": 8, "down": 12} for s in range(3)}
    w = make_pool(38, R=32, ranks=ranks, layout=layout)
    x, ids, tw, w_gu, w_d, base_align, align, mapping = named_layer(38, w, 17, 2)
    with launch_guard():
        plain = fused_moe(x, ids, tw, w_gu, w_d, align=base_align)
        sep = fused_moe(x, ids, tw, w_gu, w_d, align=base_align, deltas=MoELoRAInputs(w, align, max_rank=16))
        epi = fused_moe(x, ids, tw, w_gu, w_d, align=base_align,
                        deltas=MoELoRAInputs(w, align, max_rank=16, expand_in_gemm=True, token_lora_mapping=mapping))
    assert_close(epi.cpu(), sep.cpu(), dtype=torch.float32, what=f"{layout}, max_rank 16 of R 32", seed=38)
    base_rows = (mapping == -1).cpu()
    assert_bitwise_equal(epi.cpu()[base_rows], plain.cpu()[base_rows], what="base rows")


def _refusal_case():
    w = make_pool(34)
    x, ids, _, w_gu, _, base_align, align, mapping = named_layer(34, w, 5, 2)
    return w, x, ids, w_gu, base_align, gemm_lora("gate_up", x, w, align, ids, mapping), align, mapping


@pytest.mark.parametrize("change, match", [
    (lambda g: g.__class__(g.intermediate, g.lora_b[:1], g.ranks[:1], g.scalings[:1], g.token_lora_mapping, 2, 16),
     "slices of"),
    (lambda g: g.__class__(g.intermediate[:, :-1], g.lora_b, g.ranks, g.scalings, g.token_lora_mapping, 2, 16),
     "lora.intermediate"),
    (lambda g: g.__class__(g.intermediate, g.lora_b, g.ranks, g.scalings, g.token_lora_mapping, 2, 17),
     "max_rank"),
    (lambda g: g.__class__(g.intermediate, g.lora_b, g.ranks, g.scalings, g.token_lora_mapping[:2], 2, 16),
     "token_lora_mapping"),
    (lambda g: g.__class__(g.intermediate, g.lora_b, g.ranks.float(), g.scalings, g.token_lora_mapping, 2, 16),
     "lora.ranks"),
    (lambda g: (g.intermediate, g.lora_b), "expected a GemmLoRA"),
    # pairs of top_k 2 read with another top_k would take other tokens' slots
    (lambda g: g.__class__(g.intermediate, g.lora_b, g.ranks, g.scalings, g.token_lora_mapping.repeat(2), 4, 16),
     "lora.top_k"),
])
def test_launcher_refuses_operands_that_do_not_fit_and_writes_nothing(change, match):
    _, x, ids, w_gu, base_align, lora, _, _ = _refusal_case()
    M, k = ids.shape
    out = poisoned(M * k, 48, dtype=torch.float32)
    with pytest.raises(KernelPreconditionError, match=match):
        fused_moe_gemm(x, w_gu, out, base_align, top_k=k, num_pairs=M * k, in_row_div=k, lora=change(lora))
    assert bool(out.isnan().all())


def test_the_expand_in_the_gemm_is_not_for_an_add_into_gemm_and_needs_the_token_map():
    w, x, ids, w_gu, base_align, lora, align, _ = _refusal_case()
    M, k = ids.shape
    with pytest.raises(KernelPreconditionError, match="no add_into"):
        fused_moe_gemm(x, w_gu, poisoned(M * k, 48, dtype=torch.float32), base_align, top_k=k, num_pairs=M * k, in_row_div=k, lora=lora,
                       add_into=True)
    with pytest.raises(KernelPreconditionError, match="needs token_lora_mapping"):
        MoELoRAInputs(w, align, expand_in_gemm=True)


def _compile_case(stage, R, block_m, block_n, block_k, num_warps, num_stages, lora=True):
    """The Qwen3-30B-A3B base GEMM of ``stage`` at M = 8192 (bf16), with or without the expand."""
    H, inter, E, L, k, pairs = 2048, 768, 128, 4, 8, 65536
    N, K, S = (2 * inter, H, 2) if stage == "gate_up" else (H, inter, 1)
    ns = N // S
    args = {"a_ptr": "bf16", "w_ptr": "bf16", "c_ptr": "bf16", "sorted_token_ids_ptr": "i32", "expert_ids_ptr": "i32",
            "num_tokens_post_padded_ptr": "i32", "topk_weights_ptr": "fp32", "scale_ptr": "fp32", "bias_ptr": "bf16",
            "lora_t_ptr": "bf16", "lora_b_ptr": "bf16", "lora_scal_ptr": "fp32", "lora_rank_ptr": "i32",
            "lora_mapping_ptr": "i32", "lora_enabled_ptr": "i32",
            "N": N, "K": K, "num_pairs": pairs, "in_row_div": k if stage == "gate_up" else 1, "experts_per_scale": 1,
            "experts_per_weight": 1, "num_experts": E, "lora_L": L, "lora_Ns": ns, "lora_E": E, "lora_top_k": k, "lora_rank_bound": R,
            "stride_am": K, "stride_ak": 1, "stride_we": N * K, "stride_wn": K, "stride_wk": 1, "stride_cm": N,
            "stride_cn": 1, "stride_bias_e": 0, "stride_bias_n": 0, "stride_lt_s": pairs * R, "stride_lt_p": R,
            "stride_lb_s": L * E * ns * R, "stride_lb_l": E * ns * R, "stride_lb_e": ns * R, "stride_lb_n": R}
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "MUL_ROUTED_WEIGHT": stage == "down",
              "HAS_SCALE": False, "HAS_BIAS": False, "ADD_INTO": False, "DOT_PRECISION": "tf32", "UPCAST": False,
              "GROUP_SIZE_M": 16, "HAS_LORA": lora, "LORA_S": S, "LORA_BLOCK_L": L, "BLOCK_R": R,
              "LORA_HAS_ENABLED": True}
    return {"args": args, "constexprs": consts, "num_warps": num_warps, "num_stages": num_stages}


def test_the_base_gemm_with_the_expand_compiles_for_the_h200():
    """Both stages at R 16 and 64 with the H100 table's large-M tiles (BLOCK_N 256, 8 warps, 4 stages)
    and a 128-wide tile, and the GEMM without the expand, compiled for sm_90 here."""
    cases = {}
    for stage in ("gate_up", "down"):
        for R in (16, 64):
            cases[f"{stage} R={R} 64x256"] = _compile_case(stage, R, 64, 256, 64, 8, 4)
            cases[f"{stage} R={R} 128x128"] = _compile_case(stage, R, 128, 128, 64, 8, 3)
        cases[f"{stage} no LoRA"] = _compile_case(stage, 16, 64, 256, 64, 8, 4, lora=False)
    results = compile_for_h200("moelora_kernels._fused_moe_kernels:_fused_moe_gemm_kernel", list(cases.values()))
    for name, r in zip(cases, results, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 < r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
