"""The MoE-LoRA shrink's A tiles through a TMA tensor descriptor (config key ``A_DESC`` of
``moe_lora_shrink`` and ``fused_moe_lora``; ``moe_lora.lora_a_descriptor``).

With 1 a block whose slot's rank equals the tile's BLOCK_R reads its A tiles [BLOCK_R, BLOCK_K] from a 2-D
descriptor over the pool's A rows [S·L·E·R, K] (its box is then exactly the slot's rank rows; K past its
end reads zeros); a smaller rank, or a layout no descriptor describes (a stride-0 shared factor), keeps
the masked pointer loads. Same products; their order inside the dot of a transposed tile is the dot's, so
results are judged against the twin within tolerance, not bit for bit against 0.

Covers: drawn problems (both stages; the fused kernel and the pair's shrink; pools of R 8-64, powers of two
and not, with mixed module ranks, absent modules and empty slots, per-expert and shared layouts; base
tokens; a host max_rank below R) with NaN in every A row and B column past its slot's rank: each value
equals the twin within tolerance, every output column the delta must not touch keeps its bits (NaN and
-0.0 poison), and a descriptor was made wherever the layout allows one. Named: full-rank slots of a pool
whose max_rank is half its R (the box of BLOCK_R rows stops at the slot's rank, the NaN rows after it
never read); each layout's descriptor or none, with its exact extent; int32 row bounds; the launcher
hands both kernels the descriptor (and None at 0); invalid values refused before any write; the whole
layer against the fp64 oracle with the value set through the config table (both paths); both kernels
compile for sm_90 at the Qwen3 tiles with the descriptor, reading their A tiles by TMA.
"""

import importlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import (
    DEVICE,
    H200_MAX_SHARED,
    LaunchSpy,
    assert_bitwise_equal,
    assert_close,
    compile_for_h200,
    launch_guard,
    poisoned,
)
from moe_lora_testing import (
    check_layer_with_table,
    enabled_of,
    make_pool,
    named_routing,
    poison_intermediate_past_rank,
    poison_past_rank,
    poisoned_stage_problem,
    qwen3_gate_up_args,
    qwen3_pair_args,
    slot_ranks,
    stage_inputs,
)

from moelora_conformance.profiles import current_profile
from moelora_core import KernelPreconditionError
from moelora_kernels import (
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_lora_align_block_size,
    stage_tensors,
)
from moelora_kernels.moe_lora import A_DESC, lora_a_descriptor
from moelora_reference import moe_lora_ops as twin

pytestmark = pytest.mark.interpreter

STAGES = ("gate_up", "down")
LAYOUTS = ("per_expert", "shared_outer", "fully_shared")
moe_lora = importlib.import_module("moelora_kernels.moe_lora")  # the module (the package exports functions)


class _DescriptorCount:
    """Wraps ``lora_a_descriptor``: counts the descriptors the launchers made (the variant ran)."""

    def __init__(self):
        self.made, self.asked = 0, 0
        self.real = moe_lora.lora_a_descriptor

    def __call__(self, *args):
        d = self.real(*args)
        self.asked += 1
        self.made += d is not None
        return d


class _NegatedProbe(_DescriptorCount):
    """Stands in for ``lora_a_descriptor``: where the real one makes a descriptor, one over a negated copy of
    A instead (kept alive here), so every block that reads its A tiles through the descriptor adds the
    negated delta: which blocks took it shows in the output."""

    def __call__(self, lora_a, block_r, block_k):
        self.asked += 1
        if self.real(lora_a, block_r, block_k) is None:
            return None
        self.copy = lora_a.clone().neg_()
        self.made += 1
        return self.real(self.copy, block_r, block_k)


def _desc_blocks_negated(lora_a, ranks, max_rank):
    """A copy of ``lora_a`` [S, L, E, R, K] (or [L, E, R, K]) with (slice, slot) negated wherever the slot's
    rank, under the host bound, equals the tile's BLOCK_R (the blocks that read A through a descriptor)."""
    a = lora_a.clone()
    view, ranks = (a, ranks) if a.dim() == 5 else (a[None], ranks[None])
    bound = max_rank if max_rank is not None else view.shape[3]
    block_r = max(16, 1 << (bound - 1).bit_length())
    for s in range(view.shape[0]):
        for slot in range(view.shape[1]):
            if min(int(ranks[s, slot]), bound) == block_r:
                view[s, slot].neg_()
    return a


def run(path, stage, x, out, w, align, mapping, k, tw, enabled, max_rank, value):
    """One stage's delta with ``A_DESC`` = ``value``: the fused kernel, or the pair (the shrink with the
    value into a poisoned intermediate, NaN past each rank, then the expand)."""
    t = stage_tensors(w, stage)
    common = dict(stage=stage, top_k=k, ranks=t["ranks"], adapter_enabled=enabled, max_rank=max_rank)
    with launch_guard():
        if path == "fused":
            return fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, **common, scalings=t["scalings"],
                                  topk_weights=tw, config={"A_DESC": value})
        S = 2 if stage == "gate_up" else 1
        pairs = x.shape[0] * k if stage == "gate_up" else x.shape[0]
        inter = poisoned(S, pairs, w.spec.R, dtype=x.dtype)
        fused_moe_lora_shrink(x, t["lora_a"], align, **common, out=inter, config={"A_DESC": value})
    poison_intermediate_past_rank(inter, stage, mapping, k, t["ranks"], max_rank)
    with launch_guard():
        return fused_moe_lora_expand(inter, t["lora_b"], align, out, **common, scalings=t["scalings"],
                                     topk_weights=tw)


def check_value(path, stage, w, ids, mapping, enabled, dtype, seed, max_rank=None, value=1, x_frame=False):
    """``A_DESC`` = ``value`` against the twin within tolerance; every column the delta must not touch
    keeps its poisoned bits. Then (value 1) the same with the descriptor over a negated copy of A
    (:class:`_NegatedProbe`): exactly the blocks of slots whose rank is BLOCK_R add the negated delta, and
    a descriptor was made wherever the layout allows one. ``x_frame``: x is a column slice of a buffer with
    NaN past K (a K tail read by the descriptor path's x loads turns the output NaN). Returns the output."""
    spec = w.spec
    k = ids.shape[1]
    align, x, out0, tw, cols = poisoned_stage_problem(w, ids, mapping, enabled, dtype, seed, stage)
    if x_frame:
        framed = torch.full((x.shape[0], x.shape[1] + 8), float("nan"), dtype=x.dtype, device=x.device)
        framed[:, :x.shape[1]] = x
        x = framed[:, :x.shape[1]]
    t = stage_tensors(w, stage)
    what = f"{path} {stage} {spec.expert_layout} R={spec.R} max_rank={max_rank} A_DESC {value}"
    twin_args = dict(stage=stage, top_k=k, ranks=t["ranks"], scalings=t["scalings"], topk_weights=tw,
                     adapter_enabled=enabled, max_rank=max_rank)
    flat0 = out0.cpu().reshape(cols.shape)
    # the pools made here are compact, so a descriptor describes every A but a shared (stride-0) one
    describable = t["lora_a"].stride(-3) != 0
    runs = [("", None, t["lora_a"])]
    if value == 1:
        negated = _desc_blocks_negated(t["lora_a"], t["ranks"], max_rank) if describable else t["lora_a"]
        runs.append((" (negated probe)", _NegatedProbe(), negated))
    for label, probe, lora_a in runs:
        real = moe_lora.lora_a_descriptor
        moe_lora.lora_a_descriptor = probe or real
        try:
            got = run(path, stage, x, out0.clone(), w, align, mapping, k, tw, enabled, max_rank, value)
        finally:
            moe_lora.lora_a_descriptor = real
        want = twin.fused_moe_lora(x, lora_a, t["lora_b"], align, out0.clone(), **twin_args)
        flat = {"got": got.cpu().reshape(cols.shape), "want": want.cpu().reshape(cols.shape)}
        assert_close(flat["got"][cols], flat["want"][cols], dtype=dtype, what=f"{what}{label} vs twin", seed=seed)
        assert_bitwise_equal(flat["got"][~cols], flat0[~cols], what=f"{what}{label}: columns not to touch", seed=seed)
        if probe is not None and x.shape[0]:
            assert (probe.asked, probe.made) == (1, int(describable)), (what, probe.asked, probe.made)
    return got


# --- named cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("stage", STAGES)
def test_full_rank_slots_under_a_host_rank_bound_read_only_their_rows(stage, path):
    # pool R 32 with max_rank 16: BLOCK_R 16 < R, so the descriptor's box (16 rows from the slot's first)
    # must stop at the slot's rank: rows 16..31 hold NaN; slots 0 and 2 at rank 16 take the descriptor
    # (the negated probe shows it), slot 1 (ranks 5 and 11) the pointer loads; a disabled slot 3 and base
    # tokens stay untouched
    ranks = {0: {"gate": 16, "up": 16, "down": 16}, 1: {"gate": 5, "up": 11, "down": 11},
             2: {"gate": 16, "up": 16, "down": 16}, 3: {"gate": 16, "up": 16, "down": 16}}
    w = poison_past_rank(make_pool(81, L=4, R=32, ranks=ranks, dtype=torch.float16))
    for slot in range(4):  # NaN in rows 16.. of every slot, full-rank slots included
        w.storage("gate_up_A")[:, slot, :, 16:, :] = float("nan")
        w.storage("down_A")[slot, :, 16:, :] = float("nan")
    _, ids, mapping = named_routing(81, w.spec, 31, 2)
    mapping[::7] = -1
    enabled = torch.tensor([1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    check_value(path, stage, w, ids, mapping.to(DEVICE), enabled, torch.float16, 81, max_rank=16)


@pytest.mark.parametrize("R", [8, 12, 24])
def test_full_rank_slots_of_a_pool_whose_rank_is_not_the_tile_keep_pointer_loads(R):
    # R 8 (BLOCK_R 16: the floor of the rank tile), 12 and 24 (not powers of two): a slot at full rank R is
    # below BLOCK_R, so its blocks keep the pointer loads (a box of BLOCK_R rows would run into the next
    # expert's rows); the negated probe shows no block read through the descriptor
    ranks = {0: {"gate": R, "up": R, "down": R}, 1: {"gate": 3, "up": R, "down": 5}}
    w = poison_past_rank(make_pool(87, L=2, R=R, ranks=ranks))
    _, ids, mapping = named_routing(87, w.spec, 21, 2)
    for stage in STAGES:
        for path in ("fused", "pair"):
            check_value(path, stage, w, ids, mapping, enabled_of(mapping, 2), torch.float32, 87)


@pytest.mark.parametrize("path", ["fused", "pair"])
def test_x_columns_past_k_are_never_read(path):
    # x (the tokens for gate_up, h for down) a column slice of a buffer with NaN past K: the descriptor
    # path's x loads stop at K as the pointer path's do (the A box's zero padding past K would not
    # cancel a NaN)
    w = make_pool(88, L=2, R=16)
    _, ids, mapping = named_routing(88, w.spec, 19, 2)
    for stage in STAGES:
        check_value(path, stage, w, ids, mapping, enabled_of(mapping, 2), torch.float32, 88, x_frame=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_gets_a_descriptor_only_where_one_describes_it(layout):
    # a shared A (stride 0 over the experts) has no rows of its own per expert: no descriptor, pointer
    # loads, the same results; per_expert factors get one (check_value's probe counts them)
    w = poison_past_rank(make_pool(82, L=2, R=16, layout=layout))
    _, ids, mapping = named_routing(82, w.spec, 17, 2)
    for stage in STAGES:
        for path in ("fused", "pair"):
            check_value(path, stage, w, ids, mapping, enabled_of(mapping, 2), torch.float32, 82)


def test_the_descriptor_covers_exactly_the_pool_rows():
    w = make_pool(83, L=3, E=5, H=40, I=24, R=16)
    a = stage_tensors(w, "gate_up")["lora_a"]
    d = lora_a_descriptor(a, 16, 32)
    assert list(d.shape) == [2 * 3 * 5 * 16, 40] and list(d.strides) == [40, 1] and list(d.block_shape) == [16, 32]
    assert d.base.data_ptr() == a.data_ptr() and d.padding == "zero"
    down = stage_tensors(w, "down")["lora_a"].unsqueeze(0)  # the launchers' [1, L, E, R, I]
    d = lora_a_descriptor(down, 16, 16)
    assert list(d.shape) == [3 * 5 * 16, 24] and list(d.strides) == [24, 1]


def test_layouts_no_descriptor_takes_get_none():
    base = torch.zeros(2, 3, 4, 16, 64, dtype=torch.float16, device=DEVICE)
    assert lora_a_descriptor(base, 16, 16) is not None
    assert lora_a_descriptor(base[:, :2], 16, 16) is None  # slots of a wider pool: a gap between slices
    assert lora_a_descriptor(base[:, :, :, :8], 8, 16) is None  # rank rows of a wider pool: a gap per expert
    off = torch.zeros(2, 3, 4, 16, 68, dtype=torch.float16, device=DEVICE)[..., :64]
    assert lora_a_descriptor(off, 16, 16) is None  # a row stride of 136 bytes: off 16 bytes
    flat = torch.zeros(2 * 3 * 4 * 16 * 64 + 8, dtype=torch.float16, device=DEVICE)
    assert lora_a_descriptor(flat[4:4 + base.numel()].view(base.shape), 16, 16) is None  # base off 16 bytes
    padded = lora_a_descriptor(base[..., :40], 16, 16)  # rows padded past K: the descriptor stops at K
    assert list(padded.shape) == [2 * 3 * 4 * 16, 40] and list(padded.strides) == [64, 1]
    assert lora_a_descriptor(base[:, :, :1].expand(2, 3, 4, 16, 64), 16, 16) is None  # shared over experts
    assert lora_a_descriptor(base.transpose(3, 4), 16, 16) is None  # K not contiguous
    # rows past int32: S·L·E·R + BLOCK_R reaches 2^31
    assert lora_a_descriptor(torch.empty(1, 1, 2 ** 25 - 1, 64, 16, dtype=torch.float16, device="meta"), 64, 16) is None
    assert lora_a_descriptor(torch.empty(1, 1, 2 ** 25 - 2, 64, 16, dtype=torch.float16, device="meta"), 64,
                             16) is not None


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("value, expect", [(1, ("TensorDescriptor", True)), (0, ("NoneType", False))])
def test_the_launcher_hands_the_kernel_the_descriptor(path, value, expect, monkeypatch):
    name = "_fused_moe_lora_kernel" if path == "fused" else "_moe_lora_shrink_kernel"
    # the kernel's third argument is the descriptor (None at 0)
    spy = LaunchSpy(getattr(moe_lora, name), lambda args, kwargs: (type(args[2]).__name__, kwargs["A_DESC"]))
    monkeypatch.setattr(moe_lora, name, spy)
    w = make_pool(84, L=2, R=16)
    _, ids, mapping = named_routing(84, w.spec, 9, 2)
    check_value(path, "gate_up", w, ids, mapping, enabled_of(mapping, 2), torch.float32, 84, value=value)
    assert spy.seen == [expect] * (2 if value else 1)  # value 1: the real descriptor, then the negated probe


@pytest.mark.parametrize("M", [6, 0])
@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("bad", [2, -1, 1.0, True, "1", None])
def test_an_invalid_value_is_refused_before_any_write(path, bad, M):
    # at any batch size, the empty one included (the config is checked before the empty-batch return)
    w = make_pool(85, L=2, R=8)
    empty = {"ids": torch.zeros(0, 2, dtype=torch.int32), "mapping": torch.zeros(0, dtype=torch.int32)} if M == 0 else {}
    gen, ids, mapping = named_routing(85, w.spec, M, 2, **empty)
    enabled = enabled_of(mapping, 2)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, w.spec.E, 32, 2, enabled)
    x, out, _ = stage_inputs(gen, "gate_up", M, 2, w.spec.H, w.spec.I, torch.float32, None)
    t = stage_tensors(w, "gate_up")
    inter = poisoned(2, 2 * M, 8, dtype=torch.float32)
    before, inter_before = out.clone(), inter.clone()
    with pytest.raises(KernelPreconditionError, match=re.escape(f"A_DESC: must be one of {A_DESC}, got {bad!r}")):
        with launch_guard():
            if path == "fused":
                fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, stage="gate_up", top_k=2, ranks=t["ranks"],
                               scalings=t["scalings"], adapter_enabled=enabled, config={"A_DESC": bad})
            else:
                fused_moe_lora_shrink(x, t["lora_a"], align, stage="gate_up", top_k=2, ranks=t["ranks"],
                                      adapter_enabled=enabled, out=inter, config={"A_DESC": bad})
    assert_bitwise_equal(out, before, what="out after a refused A_DESC")
    assert_bitwise_equal(inter, inter_before, what="intermediate after a refused A_DESC")


@pytest.mark.parametrize("path", ["fused", "pair"])
def test_layer_with_the_value_from_the_table_matches_oracle(path, tmp_path, monkeypatch):
    # the value reaches the kernels through the config table the shipped launcher reads, down to the
    # path choice (moe_lora_path FUSED); fp32, mixed ranks (slots at rank 16 = BLOCK_R take the
    # descriptor), against the fp64 oracle; both stages' launches made a descriptor
    count = _DescriptorCount()
    monkeypatch.setattr(moe_lora, "lora_a_descriptor", count)
    check_layer_with_table(86, monkeypatch, tmp_path, keys={"A_DESC": 1}, ops=("fused_moe_lora", "moe_lora_shrink"),
                           fused=int(path == "fused"), what=f"{path}, A_DESC 1")
    assert count.made == count.asked == 2, (count.made, count.asked)


def test_both_kernels_compile_for_the_h200_reading_a_by_tma():
    # the shipped Qwen3 tiles with the descriptor: the fused kernel (gate_up R 16 and 64, down R 64) and
    # the pair's shrink (R 16, 64); each reads its A tiles by TMA (cp.async.bulk.tensor.2d in the PTX)
    fused, names = [], []
    for stage, R, (bk, bn, n_split) in (("gate_up", 16, (256, 256, 1)), ("gate_up", 64, (128, 128, 1)),
                                        ("down", 64, (128, 128, 2))):
        args = qwen3_gate_up_args(R) | {"a_desc": {"desc": "bf16", "block": [R, bk]}}
        if stage == "down":
            args |= {"K": 768, "N": 2048, "in_row_div": 1, "stride_xm": 768, "stride_bn": R, "stride_om": 2048,
                     "stride_os": 2048}
        consts = {"BLOCK_M": 16, "BLOCK_R": R, "BLOCK_K": bk, "BLOCK_N": bn, "N_SPLIT": n_split, "BLOCK_L": 4,
                  "EXPAND_LOADS": 1, "RANK_ALIGN": 8, "EXPAND_STAGES": 1, "A_DESC": True, "HAS_ENABLED": True,
                  "MUL_ROUTED_WEIGHT": stage == "down", "DOT_PRECISION": "tf32", "UPCAST": False, "PDL": False}
        fused.append({"args": args, "constexprs": consts, "num_warps": 4, "num_stages": 3})
        names.append(f"fused {stage} R={R}")
    shrink = []
    for R in (16, 64):
        args = qwen3_pair_args("shrink", R) | {"a_desc": {"desc": "bf16", "block": [R, 128]}}
        consts = {"BLOCK_M": 16, "BLOCK_R": R, "BLOCK_K": 128, "BLOCK_L": 4, "A_DESC": True, "HAS_ENABLED": True,
                  "DOT_PRECISION": "tf32", "UPCAST": False, "PDL": False}
        shrink.append({"args": args, "constexprs": consts, "num_warps": 4, "num_stages": 4})
        names.append(f"shrink R={R}")
    results = (compile_for_h200("moelora_kernels._moe_lora_kernels:_fused_moe_lora_kernel", fused)
               + compile_for_h200("moelora_kernels._moe_lora_kernels:_moe_lora_shrink_kernel", shrink))
    for name, r in zip(names, results, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 < r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
        assert r["global_loads"].get("cp.async.bulk.tensor.2d", 0) >= 1, f"{name}: no TMA load: {r['global_loads']}"


# --- drawn problems (last: on a GPU the named cases run first within a call's budget) --------------


@st.composite
def pools(draw):
    """(seed, pool spec kwargs, ranks per slot, max_rank) within the profile's caps: R any of 8-64
    (powers of two, where full-rank slots take the descriptor, and not), slot ranks in [1, R] with
    some slots at R, modules absent, empty slots, a host max_rank below R at times."""
    caps = current_profile().caps
    R = draw(st.sampled_from([r for r in (8, 12, 16, 24, 32, 64) if r <= caps.max_rank]), label="R")
    L = draw(st.integers(1, caps.max_loras), label="L")
    E = draw(st.integers(2, caps.max_experts), label="E")
    H = 8 * draw(st.integers(1, max(1, caps.max_hidden // 8)), label="H / 8")  # 16-byte rows in fp16
    I = 8 * draw(st.integers(1, max(1, caps.max_intermediate // 8)), label="I / 8")
    ranks = slot_ranks(draw, L, R)
    for slot in list(ranks)[:1]:  # slot 0 at full rank: the descriptor's case
        ranks[slot] = {m: R for m in ("gate", "up", "down")}
    layout = draw(st.sampled_from(LAYOUTS), label="expert layout")
    bound = draw(st.sampled_from([None, R // 2]), label="max_rank") if R >= 16 else None
    if bound is not None:
        ranks = {s: {m: min(r, bound) for m, r in mods.items()} for s, mods in ranks.items()}
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    return seed, {"L": L, "E": E, "H": H, "I": I, "R": R, "layout": layout}, ranks, bound


@given(problem=pools(), data=st.data())
def test_the_descriptor_path_matches_the_twin(problem, data):
    seed, kw, ranks, bound = problem
    caps = current_profile().caps
    dtype = data.draw(st.sampled_from(caps.dtypes), label="dtype")
    path = data.draw(st.sampled_from(["fused", "pair"]), label="path")
    w = poison_past_rank(make_pool(seed, dtype=dtype, ranks=ranks, **kw))
    M = data.draw(st.integers(1, caps.max_tokens), label="M")
    _, ids, mapping = named_routing(seed, w.spec, M, min(2, w.spec.E))
    enabled = enabled_of(mapping, w.spec.max_loras)
    for stage in STAGES:
        check_value(path, stage, w, ids, mapping, enabled, dtype, seed, max_rank=bound)
