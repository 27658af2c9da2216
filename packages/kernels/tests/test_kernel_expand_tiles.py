"""Column tiles per program of the shrink/expand pair's expand (config key ``N_TILES`` of
``moe_lora_expand``).

With 1 a program owns one column tile of one (block, slice) and walks the block's metadata, pairs and
t before its one dot; with n it owns n consecutive tiles, loads those once, and loads each tile's B and
old output one tile ahead of its dot. Each output element gets the same operands and the same arithmetic
(one dot over the rank, σ, the router weight, one rounding), so every value must equal 1 bit for bit;
tiles of a group past N are masked out entirely (``_moe_lora_kernels`` docstring).

Covers: drawn problems (both stages, R 8-64 with mixed module ranks, absent modules and empty slots,
per-expert and stride-0 shared-factor layouts, fp32 and fp16, column tiles of 16 and 32, widths that
leave a group's last tiles past N, values above the tile count) with NaN in every factor column past its
slot's rank and in the intermediate past it: each value equals 1 bit for bit and the twin within
tolerance, and every output column the delta must not touch keeps its poisoned bits. Named: expert ids
-1, E and E+1 with a disabled slot and base tokens; the whole layer against the fp64 oracle with the
value set through the config table on the pair's path; invalid values refused before any write; the
expand compiles for sm_90 at the Qwen3 gate_up stage with 2, 3 and 6 tiles per program.
"""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import (
    DEVICE,
    H200_MAX_SHARED,
    assert_bitwise_equal,
    assert_close,
    compile_for_h200,
    launch_guard,
)
from moe_lora_testing import (
    check_layer_with_table,
    enabled_of,
    make_pool,
    named_routing,
    poison_past_rank,
    poisoned_stage_problem,
    qwen3_pair_args,
    shrink_for_pair,
    slot_ranks,
    stage_inputs,
)

from moelora_conformance.profiles import current_profile
from moelora_core import KernelPreconditionError
from moelora_kernels import (
    fused_moe_lora_expand,
    moe_lora_align_block_size,
    stage_tensors,
)
from moelora_kernels.expand_stream import RANK_VECTOR
from moelora_kernels.moe_lora import MAX_N_TILES
from moelora_reference import moe_lora_ops as twin

pytestmark = pytest.mark.interpreter

STAGES = ("gate_up", "down")


def expand(stage, inter, out, w, align, k, tw, enabled, max_rank, **cfg):
    """The pair's expand of one stage on ``inter`` with the config ``cfg`` (``N_TILES``, ``BLOCK_N``)."""
    t = stage_tensors(w, stage)
    with launch_guard():
        fused_moe_lora_expand(inter, t["lora_b"], align, out, stage=stage, top_k=k, ranks=t["ranks"],
                              scalings=t["scalings"], topk_weights=tw, adapter_enabled=enabled, max_rank=max_rank,
                              config=cfg)
    return out


def check_tiles(stage, w, ids, mapping, enabled, dtype, seed, values, *, block_n=32, max_rank=None, stream=0):
    """Each ``N_TILES`` of ``values`` against 1, bit for bit, and 1 against the twin within tolerance, at
    ``EXPAND_STREAM`` = ``stream`` (1: the rank-rounded load mask, whose columns past the rank each tile
    zeroes); every column the delta must not touch keeps its poisoned bits. Returns the 1-tile output and
    the input."""
    k = ids.shape[1]
    align, x, out0, tw, cols = poisoned_stage_problem(w, ids, mapping, enabled, dtype, seed, stage)
    inter = shrink_for_pair(stage, x, w, align, k, enabled, mapping, max_rank)
    what = f"{stage} {w.spec.expert_layout} R={w.spec.R} BLOCK_N={block_n} max_rank={max_rank} EXPAND_STREAM={stream}"
    cfg = {"BLOCK_N": block_n, "EXPAND_STREAM": stream}
    one = expand(stage, inter, out0.clone(), w, align, k, tw, enabled, max_rank, N_TILES=1, **cfg)
    t = stage_tensors(w, stage)
    want = twin.fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out0.clone(), stage=stage, top_k=k,
                               ranks=t["ranks"], scalings=t["scalings"], topk_weights=tw, adapter_enabled=enabled,
                               max_rank=max_rank)
    flat = {"one": one.cpu().reshape(cols.shape), "want": want.cpu().reshape(cols.shape),
            "0": out0.cpu().reshape(cols.shape)}
    assert_close(flat["one"][cols], flat["want"][cols], dtype=dtype, what=f"{what}: N_TILES 1 vs twin", seed=seed)
    assert_bitwise_equal(flat["one"][~cols], flat["0"][~cols], what=f"{what}: columns not to touch", seed=seed)
    for v in values:
        got = expand(stage, inter, out0.clone(), w, align, k, tw, enabled, max_rank, N_TILES=v, **cfg)
        assert_bitwise_equal(got, one, what=f"{what}: N_TILES {v} vs 1", seed=seed)
    return one, out0


# --- named cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("stage", STAGES)
def test_sentinel_ids_disabled_slot_and_base_tokens_stay_untouched(stage, stream):
    # I 72 and H 100 at tiles of 32: 3 and 4 tiles, so 2 per program leaves the last group one tile past
    # N on gate_up, 3 leaves two on down, 5 is above both counts; ranks 3, 13, 8, 1, 16, 9; slot 2 has no
    # gate; slot 3 disabled; expert ids -1, E and E+1 among the routes; base rows among them; fp16
    ranks = {0: {"gate": 3, "up": 13, "down": 8}, 1: {"gate": 1, "up": 16, "down": 9}, 2: {"up": 7, "down": 16},
             3: {"gate": 5, "up": 5, "down": 5}}
    w = poison_past_rank(make_pool(71, L=4, H=100, I=72, R=16, ranks=ranks, dtype=torch.float16))
    E = w.spec.E
    ids = torch.tensor([[-1, 0], [E, 1], [E + 1, 4], [2, E], [4, 3], [1, 2], [0, 3]] * 5, dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, 3, 2, -1, 1] * 5, dtype=torch.int32)
    _, ids, mapping = named_routing(71, w.spec, 35, 2, ids, mapping)
    enabled = torch.tensor([1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    one, out0 = check_tiles(stage, w, ids, mapping, enabled, torch.float16, 71, values=(2, 3, 5), stream=stream)
    base_rows = (mapping.cpu() == -1).repeat_interleave(2)
    rows = one.cpu().reshape(35 * 2, -1)
    assert_bitwise_equal(rows[base_rows], out0.cpu().reshape(35 * 2, -1)[base_rows], what="base rows")
    assert not torch.equal(rows[~base_rows].nan_to_num(), out0.cpu().reshape(35 * 2, -1)[~base_rows].nan_to_num())


@pytest.mark.parametrize("value", [2, 4])
def test_layer_with_the_value_from_the_table_matches_oracle(value, tmp_path, monkeypatch):
    # the value reaches the expand through the config table the shipped launcher reads (the
    # interpreter's one config on the CPU, a copy of the shipped table on a GPU), on the pair's path
    # (moe_lora_path FUSED 0); fp32, mixed ranks, widths of several tiles of 32, against the fp64 oracle
    check_layer_with_table(72, monkeypatch, tmp_path, keys={"N_TILES": value, "BLOCK_N": 32}, ops=("moe_lora_expand",),
                           fused=0, what=f"pair, N_TILES {value}", H=100, I=72)


@pytest.mark.parametrize("bad", [0, -1, MAX_N_TILES + 1, 2.0, True, "2", None])
def test_an_invalid_value_is_refused_before_any_write(bad):
    w = make_pool(73, L=2, R=8)
    gen, ids, mapping = named_routing(73, w.spec, 6, 2)
    enabled = enabled_of(mapping, 2)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, w.spec.E, 32, 2, enabled)
    x, out, _ = stage_inputs(gen, "gate_up", 6, 2, w.spec.H, w.spec.I, torch.float32, None)
    inter = shrink_for_pair("gate_up", x, w, align, 2, enabled, mapping, None)
    before = out.clone()
    with pytest.raises(KernelPreconditionError,
                       match=re.escape(f"N_TILES: must be an int in [1, {MAX_N_TILES}], got {bad!r}")):
        expand("gate_up", inter, out, w, align, 2, None, enabled, None, N_TILES=bad)
    assert_bitwise_equal(out, before, what="out after a refused N_TILES")
    # an empty batch is no exception (the value is checked before the launcher returns early)
    empty_ids, empty_map = ids[:0], mapping[:0]
    with launch_guard():
        empty = moe_lora_align_block_size(empty_ids, empty_map, w.spec.E, 32, 2, enabled)
    with pytest.raises(KernelPreconditionError, match=re.escape(f"N_TILES: must be an int in [1, {MAX_N_TILES}]")):
        expand("gate_up", inter[:, :0], out[:0], w, empty, 2, None, enabled, None, N_TILES=bad)


def test_a_slice_of_width_0_launches_nothing():
    # a down stage whose B has 0 output columns: no tile, an empty grid, the output untouched (the
    # per-program count is at least 1, so the launcher never divides by 0)
    w = make_pool(74, L=2, R=8)
    gen, ids, mapping = named_routing(74, w.spec, 3, 2)
    enabled = enabled_of(mapping, 2)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, w.spec.E, 32, 2, enabled)
    t = stage_tensors(w, "down")
    inter = torch.randn(1, 6, 8, generator=gen).to(DEVICE)
    out = torch.randn(3, 2, 0).to(DEVICE)
    for n in (1, 3):
        with launch_guard():
            got = fused_moe_lora_expand(inter, t["lora_b"][:, :, :0], align, out, stage="down", top_k=2,
                                        ranks=t["ranks"], scalings=t["scalings"], topk_weights=torch.rand(3, 2).to(DEVICE),
                                        adapter_enabled=enabled, config={"N_TILES": n})
        assert got is out and got.shape == (3, 2, 0)


def test_the_expand_compiles_for_the_h200_with_several_tiles_per_program():
    # the Qwen3 gate_up stage (I 768: 6 tiles of 128) at R 16 and 64 with 16-byte factor loads, 2, 3 and
    # 6 tiles per program: compiled for sm_90 here, so a GPU call does not find out first
    cases, names = [], []
    for R in (16, 64):
        for n in (2, 3, 6):
            consts = {"BLOCK_M": 16, "BLOCK_R": R, "BLOCK_N": 128, "BLOCK_L": 4, "N_TILES": n,
                      "RANK_ALIGN": RANK_VECTOR, "HAS_ENABLED": True, "MUL_ROUTED_WEIGHT": False,
                      "DOT_PRECISION": "tf32", "UPCAST": False}
            cases.append({"args": qwen3_pair_args("expand", R, n_tiles=n), "constexprs": consts, "num_warps": 4,
                          "num_stages": 2})
            names.append(f"expand R={R} N_TILES={n}")
    results = compile_for_h200("moelora_kernels._moe_lora_kernels:_moe_lora_expand_kernel", cases)
    for name, r in zip(names, results, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 <= r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
        assert "ld.global.b16" not in r["global_loads"], f"{name}: 2-byte global loads: {r['global_loads']}"


# --- drawn problems (last: on a GPU the named cases run first within a call's budget) --------------


@st.composite
def problems(draw):
    """(seed, pool spec kwargs, ranks per slot) within the profile's caps: widths of one to several
    column tiles; slot ranks in [1, R], modules absent (rank 0), empty slots."""
    caps = current_profile().caps
    R = draw(st.sampled_from([r for r in (8, 16, 32, 64) if r <= caps.max_rank]), label="R")
    L = draw(st.integers(1, caps.max_loras), label="L")
    E = draw(st.integers(2, caps.max_experts), label="E")
    H = draw(st.integers(8, max(8, caps.max_hidden)), label="H")
    I = draw(st.integers(8, max(8, caps.max_intermediate)), label="I")
    ranks = slot_ranks(draw, L, R)
    layout = draw(st.sampled_from(("per_expert", "shared_outer", "fully_shared")), label="expert layout")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    return seed, {"L": L, "E": E, "H": H, "I": I, "R": R, "layout": layout}, ranks


@given(problem=problems(), data=st.data())
def test_every_value_equals_1_bit_for_bit_and_the_twin(problem, data):
    seed, kw, ranks = problem
    caps = current_profile().caps
    dtype = data.draw(st.sampled_from(caps.dtypes), label="dtype")
    w = poison_past_rank(make_pool(seed, dtype=dtype, ranks=ranks, **kw))
    k = data.draw(st.integers(1, min(caps.max_top_k, w.spec.E)), label="top_k")
    M = data.draw(st.integers(1, min(caps.max_tokens, 48)), label="M")
    _, ids, mapping = named_routing(seed, w.spec, M, k)
    stage = data.draw(st.sampled_from(STAGES), label="stage")
    block_n = data.draw(st.sampled_from([16, 32]), label="BLOCK_N")
    value = data.draw(st.integers(2, 6), label="N_TILES")
    top = max(max(m.values()) for m in ranks.values())
    max_rank = data.draw(st.sampled_from([None, top]), label="max_rank")  # a host bound covering every rank
    stream = data.draw(st.sampled_from([0, 1]), label="EXPAND_STREAM")  # 1: each tile zeroes past the rank
    check_tiles(stage, w, ids, mapping, enabled_of(mapping, w.spec.max_loras), dtype, seed, (value,),
                block_n=block_n, max_rank=max_rank, stream=stream)
