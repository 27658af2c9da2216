"""How the MoE-LoRA expand reads its factor tiles (config key ``EXPAND_STREAM``).

0 masks the t and B tiles at each slot's exact rank; that mask varies inside every 16-byte vector of
their contiguous rank dimension, so the compiler loads them 2 bytes at a time. 1 rounds the load
mask up to 8 rank columns (where the factors' R is a multiple of 8: the mask never passes R) and sets
the columns past the rank to 0 in registers; 2-4 also software-pipeline the fused kernel's expand
loop that many stages deep. Same operands, same arithmetic: every value must equal 0 bit for bit,
and the twin within tolerance (``_moe_lora_kernels`` docstring).

Covers: drawn problems (both stages; the fused kernel and the shrink/expand pair; pools of R 8-64 with mixed module ranks, absent modules and empty slots, per-expert and
stride-0 shared-factor layouts; base tokens; a host max_rank) with NaN in every A row and B column
past its slot's rank, and on the pair in the intermediate's columns past the rank: each value equals
0 bit for bit and the twin within tolerance, and every output column the delta must not touch keeps
its bits (NaN and -0.0 poison). Named: expert ids -1, E and E+1 with a disabled slot and base
tokens; a pool whose R is not a multiple of 8 (the mask stays exact); the rounding rule never passes
R; the whole layer against the fp64 oracle with the value set through the config table (both paths);
invalid values refused before any write; the variant compiles for sm_90 at the shipped Qwen3 tiles
with no 2-byte global load left, and with the pipelined loops' B tiles copied asynchronously; the
shrink and the expand (on the flat block grid) compile for sm_90.
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
    qwen3_gate_up_args,
    qwen3_pair_args,
    shrink_for_pair,
    slot_ranks,
    stage_inputs,
)

from moelora_conformance.profiles import current_profile
from moelora_core import KernelPreconditionError
from moelora_kernels import (
    fused_moe_lora,
    fused_moe_lora_expand,
    moe_lora_align_block_size,
    stage_tensors,
)
from moelora_kernels.expand_stream import (
    EXPAND_STREAM,
    RANK_VECTOR,
    SHARED_MEMORY_LIMIT,
    expand_shared_bytes,
    expand_stages,
    rank_align,
)
from moelora_reference import moe_lora_ops as twin

pytestmark = pytest.mark.interpreter

STAGES = ("gate_up", "down")
LAYOUTS = ("per_expert", "shared_outer", "fully_shared")
NEW = tuple(v for v in EXPAND_STREAM if v)


# --- the problem ----------------------------------------------------------------------------------


def run(path, stage, x, out, w, align, k, tw, enabled, max_rank, stream, inter=None, **fused_cfg):
    """One stage's delta with ``EXPAND_STREAM`` = ``stream``: the fused kernel (``fused_cfg`` its
    other keys), or the pair's expand on ``inter`` (made by the caller's shrink)."""
    t = stage_tensors(w, stage)
    common = dict(stage=stage, top_k=k, ranks=t["ranks"], scalings=t["scalings"], topk_weights=tw,
                  adapter_enabled=enabled, max_rank=max_rank)
    with launch_guard():
        if path == "fused":
            fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, **common,
                           config={"EXPAND_STREAM": stream, **fused_cfg})
        else:
            fused_moe_lora_expand(inter, t["lora_b"], align, out, **common, config={"EXPAND_STREAM": stream})
    return out


def check_values(path, stage, w, ids, mapping, enabled, dtype, seed, max_rank=None, values=NEW, **fused_cfg):
    """Each value of ``values`` against 0, bit for bit, and the twin within tolerance; every column
    the delta must not touch keeps its poisoned bits. Returns the value-0 output and the input."""
    spec = w.spec
    k = ids.shape[1]
    align, x, out0, tw, cols = poisoned_stage_problem(w, ids, mapping, enabled, dtype, seed, stage)
    inter = shrink_for_pair(stage, x, w, align, k, enabled, mapping, max_rank) if path == "pair" else None
    what = f"{path} {stage} {spec.expert_layout} R={spec.R} max_rank={max_rank} {fused_cfg}"
    base = run(path, stage, x, out0.clone(), w, align, k, tw, enabled, max_rank, 0, inter=inter, **fused_cfg)
    t = stage_tensors(w, stage)
    want = twin.fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out0.clone(), stage=stage, top_k=k,
                               ranks=t["ranks"], scalings=t["scalings"], topk_weights=tw, adapter_enabled=enabled,
                               max_rank=max_rank)
    flat = {"base": base.cpu().reshape(cols.shape), "want": want.cpu().reshape(cols.shape),
            "0": out0.cpu().reshape(cols.shape)}
    assert_close(flat["base"][cols], flat["want"][cols], dtype=dtype, what=f"{what}: EXPAND_STREAM 0 vs twin",
                 seed=seed)
    assert_bitwise_equal(flat["base"][~cols], flat["0"][~cols], what=f"{what}: columns not to touch", seed=seed)
    for v in values:
        got = run(path, stage, x, out0.clone(), w, align, k, tw, enabled, max_rank, v, inter=inter, **fused_cfg)
        assert_bitwise_equal(got, base, what=f"{what}: EXPAND_STREAM {v} vs 0", seed=seed)
    return base, out0


# --- named cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("stage", STAGES)
def test_sentinel_ids_disabled_slot_and_base_tokens_stay_untouched(stage, path):
    # ranks 3, 13, 8, 1, 16, 9: off and on the 8-column vector; slot 2 has no gate; slot 3 disabled;
    # expert ids -1, E and E+1 among the routes; tokens of slot -1 (base rows) among them; fp16
    ranks = {0: {"gate": 3, "up": 13, "down": 8}, 1: {"gate": 1, "up": 16, "down": 9}, 2: {"up": 7, "down": 16},
             3: {"gate": 5, "up": 5, "down": 5}}
    w = poison_past_rank(make_pool(61, L=4, R=16, ranks=ranks, dtype=torch.float16))
    E = w.spec.E
    ids = torch.tensor([[-1, 0], [E, 1], [E + 1, 4], [2, E], [4, 3], [1, 2], [0, 3]] * 5, dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, 3, 2, -1, 1] * 5, dtype=torch.int32)
    _, ids, mapping = named_routing(61, w.spec, 35, 2, ids, mapping)
    enabled = torch.tensor([1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    base, out0 = check_values(path, stage, w, ids, mapping, enabled, torch.float16, 61)
    base_rows = (mapping.cpu() == -1).repeat_interleave(2)
    rows = base.cpu().reshape(35 * 2, -1)
    assert_bitwise_equal(rows[base_rows], out0.cpu().reshape(35 * 2, -1)[base_rows], what="base rows")
    assert not torch.equal(rows[~base_rows].nan_to_num(), out0.cpu().reshape(35 * 2, -1)[~base_rows].nan_to_num())


@pytest.mark.parametrize("path", ["fused", "pair"])
def test_a_pool_rank_off_the_vector_keeps_the_exact_mask(path):
    # R = 12: a mask rounded up to 16 would read past R (into the next row's columns, or past the
    # pool at its end), so the launcher keeps the exact mask; results as for 0
    assert rank_align(2, 12) == 1 and rank_align(2, 16) == RANK_VECTOR
    ranks = {0: {"gate": 12, "up": 5, "down": 11}, 1: {"gate": 9, "up": 12, "down": 3}}
    w = poison_past_rank(make_pool(62, L=2, R=12, ranks=ranks))
    _, ids, mapping = named_routing(62, w.spec, 20, 2)
    for stage in STAGES:
        check_values(path, stage, w, ids, mapping, enabled_of(mapping, 2), torch.float32, 62)


def test_the_rounded_mask_never_passes_R():
    # every rank a slot can have (0..R, after the host bound) rounded up to RANK_ALIGN stays <= R
    for R in range(1, 129):
        for value in EXPAND_STREAM:
            align = rank_align(value, R)
            assert align == (RANK_VECTOR if value and R % RANK_VECTOR == 0 else 1), (R, value, align)
            assert all(-(-r // align) * align <= R for r in range(R + 1)), (R, value)


def test_the_pipeline_depth_fits_the_shared_memory_of_an_sm_90_block():
    # a deep pipeline asked of wide tiles runs shallower (down to the unpipelined loop), never past
    # the limit: at the shipped Qwen3 tiles (bf16, BLOCK_M 16) every value keeps its depth; fp32
    # tiles of 128 rows, rank 64 and 256 columns fit no second stage
    for value in EXPAND_STREAM:
        for block_m, block_r, block_n in ((16, 16, 256), (16, 64, 128), (32, 64, 256), (64, 64, 256), (128, 64, 256)):
            for b_bytes, out_bytes in ((2, 2), (2, 4), (4, 4)):
                tiles = {"block_m": block_m, "block_r": block_r, "block_n": block_n, "b_bytes": b_bytes,
                         "out_bytes": out_bytes}
                stages = expand_stages(value, **tiles)
                assert 1 <= stages <= max(value, 1), (value, tiles, stages)
                assert stages == 1 or expand_shared_bytes(stages, **tiles) <= SHARED_MEMORY_LIMIT, (value, tiles)
                if stages < max(value, 1):  # the next deeper one would not have fitted
                    assert expand_shared_bytes(stages + 1, **tiles) > SHARED_MEMORY_LIMIT, (value, tiles)
    qwen3 = {"block_m": 16, "b_bytes": 2, "out_bytes": 2}
    assert [expand_stages(v, **qwen3, block_r=64, block_n=128) for v in EXPAND_STREAM] == [1, 1, 2, 3, 4]
    wide = {"block_m": 128, "block_r": 64, "block_n": 256, "b_bytes": 4, "out_bytes": 4}
    assert expand_stages(4, **wide) == 1


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("value", [1, 3])
def test_layer_with_the_value_from_the_table_matches_oracle(path, value, tmp_path, monkeypatch):
    # the value reaches the kernels through the config table the shipped launcher reads (the
    # interpreter's one config on the CPU, a copy of the shipped table on a GPU), down to the path
    # choice (moe_lora_path FUSED); fp32, mixed ranks, against the fp64 oracle
    check_layer_with_table(63, monkeypatch, tmp_path, keys={"EXPAND_STREAM": value},
                           ops=("fused_moe_lora", "moe_lora_expand"), fused=int(path == "fused"),
                           what=f"{path}, EXPAND_STREAM {value}")


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("bad", [5, -1, 1.0, True, "1", None])
def test_an_invalid_value_is_refused_before_any_write(path, bad):
    w = make_pool(64, L=2, R=8)
    gen, ids, mapping = named_routing(64, w.spec, 6, 2)
    enabled = enabled_of(mapping, 2)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, w.spec.E, 32, 2, enabled)
    x, out, _ = stage_inputs(gen, "gate_up", 6, 2, w.spec.H, w.spec.I, torch.float32, None)
    inter = shrink_for_pair("gate_up", x, w, align, 2, enabled, mapping, None) if path == "pair" else None
    before = out.clone()
    with pytest.raises(KernelPreconditionError, match=re.escape(f"EXPAND_STREAM: must be one of {EXPAND_STREAM}, "
                                                                f"got {bad!r}")):
        run(path, "gate_up", x, out, w, align, 2, None, enabled, None, bad, inter=inter)
    assert_bitwise_equal(out, before, what="out after a refused EXPAND_STREAM")


def test_a_slice_of_width_0_launches_nothing():
    # the pair's expand of a down stage whose B has 0 output columns: no column tile, an empty grid, the
    # output untouched (the tensors are made outside the guard: it refuses a synchronizing copy)
    w = make_pool(74, L=2, R=8)
    gen, ids, mapping = named_routing(74, w.spec, 3, 2)
    enabled = enabled_of(mapping, 2)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, w.spec.E, 32, 2, enabled)
    t = stage_tensors(w, "down")
    inter = torch.randn(1, 6, 8, generator=gen).to(DEVICE)
    out = torch.randn(3, 2, 0).to(DEVICE)
    tw = torch.rand(3, 2).to(DEVICE)
    with launch_guard():
        got = fused_moe_lora_expand(inter, t["lora_b"][:, :, :0], align, out, stage="down", top_k=2,
                                    ranks=t["ranks"], scalings=t["scalings"], topk_weights=tw,
                                    adapter_enabled=enabled)
    assert got is out and got.shape == (3, 2, 0)


def _qwen3_down_args(R, M=128, L=4, E=128, H=2048, I=768, block_m=16):
    """The fused kernel's runtime arguments for the Qwen3-30B-A3B down stage (bf16, 4 slots)."""
    args = qwen3_gate_up_args(R, M, L, E, H, I, block_m)
    return args | {"K": I, "N": H, "in_row_div": 1, "stride_xm": I, "stride_as": L * E * R * I,
                   "stride_al": E * R * I, "stride_ae": R * I, "stride_ar": I, "stride_bs": L * E * H * R,
                   "stride_bl": E * H * R, "stride_be": H * R, "stride_om": H, "stride_os": H, "stride_on": 1}


def test_the_streamed_expand_compiles_for_the_h200_with_16_byte_factor_loads():
    # the shipped Qwen3 tiles (gate_up R 16 and 64, down R 64 router-weighted) with each value's
    # constants, one wide tile set whose depth the launcher cuts (4 asked, 2 fit), and the pair's
    # expand: no 2-byte global load may remain (the point of the
    # variant), the pipelined loops copy B asynchronously, and shared memory fits (the launcher's
    # estimate bounds it); compiled for sm_90 here, so a GPU call does not find out first
    fused, names, estimates = [], [], []
    for stage, R, block_m, (bk, bn, n_split), loads, value in (
            ("gate_up", 64, 16, (128, 128, 1), 1, 1), ("gate_up", 64, 16, (128, 128, 1), 1, 3),
            ("gate_up", 16, 16, (256, 256, 2), 2, 2), ("down", 64, 16, (128, 128, 2), 1, 3),
            ("gate_up", 64, 128, (128, 256, 1), 1, 4)):
        tiles = {"block_m": block_m, "block_r": R, "block_n": bn, "b_bytes": 2, "out_bytes": 2}
        stages = expand_stages(value, **tiles)
        assert stages == (2 if value == 4 else max(value, 1)), (value, tiles, stages)
        # the shrink's K loop (freed before the expand) holds num_stages - 1 x and A tiles
        shrink = 2 * (block_m * bk + bk * R) * 2
        estimates.append(max(expand_shared_bytes(stages, **tiles), shrink) if stages > 1 else None)
        consts = {"BLOCK_M": block_m, "BLOCK_R": R, "BLOCK_K": bk, "BLOCK_N": bn, "N_SPLIT": n_split, "BLOCK_L": 4, "EXPAND_LOADS": loads, "RANK_ALIGN": rank_align(value, R),
                  "EXPAND_STAGES": stages, "HAS_ENABLED": True, "A_DESC": False,
                  "MUL_ROUTED_WEIGHT": stage == "down", "DOT_PRECISION": "tf32", "UPCAST": False, "PDL": False}
        args = qwen3_gate_up_args(R) if stage == "gate_up" else _qwen3_down_args(R)
        fused.append({"args": args, "constexprs": consts, "num_warps": 4, "num_stages": 3})
        names.append(f"fused {stage} R={R} BLOCK_M={block_m} EXPAND_STREAM={value}")
    expand = []
    for R in (64, 16):
        consts = {"BLOCK_M": 16, "BLOCK_R": R, "BLOCK_N": 128, "BLOCK_L": 4,
                  "RANK_ALIGN": RANK_VECTOR, "HAS_ENABLED": True, "MUL_ROUTED_WEIGHT": False,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "PDL": False}
        expand.append({"args": qwen3_pair_args("expand", R), "constexprs": consts, "num_warps": 4, "num_stages": 2})
        names.append(f"expand R={R}")
        estimates.append(None)
    results = (compile_for_h200("moelora_kernels._moe_lora_kernels:_fused_moe_lora_kernel", fused)
               + compile_for_h200("moelora_kernels._moe_lora_kernels:_moe_lora_expand_kernel", expand))
    for name, r, estimate in zip(names, results, estimates, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 < r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
        # the launcher's estimate of the expand's buffers holds (or the shrink's are the larger)
        assert estimate is None or r["shared"] <= estimate, f"{name}: {r['shared']} B > {estimate} B estimated"
        assert "ld.global.b16" not in r["global_loads"], f"{name}: 2-byte global loads left: {r['global_loads']}"
        if "EXPAND_STREAM=1" not in name and name.startswith("fused"):
            # every tile load of the pipelined expand loop is asynchronous (only the metadata, σ and
            # router-weight scalars stay plain loads)
            assert not any(op.startswith("ld.global.v") for op in r["global_loads"]), f"{name}: {r['global_loads']}"


@pytest.mark.parametrize("kernel", ["shrink", "expand"])
def test_shrink_and_expand_compile_for_the_h200(kernel):
    # the interpreter runs code the GPU compiler may reject (tl.cumsum's layout in the flat block grid,
    # the scalar slot from a reduction): compile both for sm_90 here, so a GPU call does not find out first
    name = {"shrink": "_moe_lora_shrink_kernel", "expand": "_moe_lora_expand_kernel"}[kernel]
    cases = []
    for R in (16, 64):
        consts = {"BLOCK_M": 16, "BLOCK_R": R, "BLOCK_L": 4, "HAS_ENABLED": True, "DOT_PRECISION": "tf32",
                  "UPCAST": False, "PDL": False}
        # (the expand with the exact rank masks of EXPAND_STREAM 0; the streamed one is compiled above)
        consts |= ({"BLOCK_K": 128, "A_DESC": False} if kernel == "shrink"
                   else {"BLOCK_N": 128, "MUL_ROUTED_WEIGHT": False, "RANK_ALIGN": 1})
        cases.append({"args": qwen3_pair_args(kernel, R), "constexprs": consts, "num_warps": 4, "num_stages": 3})
    results = compile_for_h200(f"moelora_kernels._moe_lora_kernels:{name}", cases)
    for R, r in zip((16, 64), results, strict=True):
        assert "error" not in r, f"{kernel} R={R}: {r.get('error')}"
        assert 0 <= r["shared"] <= H200_MAX_SHARED, f"{kernel} R={R}: shared memory {r['shared']} B"


# --- drawn problems (last: on a GPU the named cases run first within a call's budget) --------------


@st.composite
def pools(draw):
    """(seed, pool spec kwargs, ranks per slot) within the profile's caps, R a multiple of 8 (where
    the rounded mask is on); slot ranks in [1, R], modules absent (rank 0), empty slots."""
    caps = current_profile().caps
    R = draw(st.sampled_from([r for r in (8, 16, 32, 64) if r <= caps.max_rank]), label="R")
    # the Qwen3-30B-A3B layer in a quarter of the GPU draws, with at most 2 slots: its factors are
    # drawn on the host (~70 M values a slot)
    qwen3 = caps.model_shapes and not draw(st.integers(0, 3), label="qwen3 layer")
    L = draw(st.integers(1, 2 if qwen3 else caps.max_loras), label="L")
    if qwen3:
        E, H, I = 128, 2048, 768
    else:
        E = draw(st.integers(2, caps.max_experts), label="E")
        H = draw(st.integers(8, caps.max_hidden), label="H")
        I = draw(st.integers(8, caps.max_intermediate), label="I")
    ranks = slot_ranks(draw, L, R)
    layout = draw(st.sampled_from(LAYOUTS), label="expert layout")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    return seed, {"L": L, "E": E, "H": H, "I": I, "R": R, "layout": layout}, ranks


@given(problem=pools(), data=st.data())
def test_every_stream_value_equals_0_bit_for_bit_and_the_twin(problem, data):
    seed, kw, ranks = problem
    caps = current_profile().caps
    dtype = data.draw(st.sampled_from(caps.dtypes), label="dtype")
    w = poison_past_rank(make_pool(seed, dtype=dtype, ranks=ranks, **kw))
    k = data.draw(st.integers(1, min(caps.max_top_k, w.spec.E)), label="top_k")
    M = data.draw(st.integers(1, min(caps.max_tokens, 48)), label="M")
    _, ids, mapping = named_routing(seed, w.spec, M, k)
    enabled = enabled_of(mapping, w.spec.max_loras)
    stage = data.draw(st.sampled_from(STAGES), label="stage")
    path = data.draw(st.sampled_from(["fused", "pair"]), label="path")
    top = max(max(m.values()) for m in ranks.values())
    max_rank = data.draw(st.sampled_from([None, top]), label="max_rank")  # a host bound covering every rank
    value = data.draw(st.sampled_from(NEW), label="EXPAND_STREAM")
    if path == "fused":
        extra = {"EXPAND_LOADS": data.draw(st.sampled_from([0, 1, 2]), label="EXPAND_LOADS"),
                 "N_SPLIT": data.draw(st.sampled_from([1, 2, 3]), label="N_SPLIT")}
    else:
        extra = {}
    check_values(path, stage, w, ids, mapping, enabled, dtype, seed, max_rank=max_rank, values=(value,), **extra)
