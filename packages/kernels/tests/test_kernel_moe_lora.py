"""The MoE-LoRA shrink / expand / fused kernels against their twins (``moelora_reference.moe_lora_ops``).

Covers: drawn cases for both stages and the two paths (fused shrink+expand; shrink then expand):
output equal to the twin within the dtype's tolerance, every row (and slice) the kernels must not
touch bit-identical; the shrink's intermediate on handled rows, NaN elsewhere; the whole layer
with LoRA against the fp64 oracle (fp32). Named cases: the pair with mixed ranks, a disabled slot
and sentinel ids; gate_A != up_A; rank < R and mixed ranks
(with and without a host max_rank); base tokens in a mixed batch bit-identical to a LoRA-free run;
disabled slots; expert ids -1, E and E+1; a single token; all tokens to one expert; empty experts;
top_k = 1; an IDLE batch; launcher precondition errors (rank > R, an intermediate of another
shape among them); a max_rank below a loaded slot's rank, refused by ``moe_lora_delta``. Named cases
on the flat block grid, with sentinel-padded inputs and poisoned outputs
(``moe_lora_testing.check_sentinel_stage``): five slots (not a power of two) of uneven blocks; every
pair in its own (slot, expert) group, so the used blocks reach the host's grid bounds.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close, cpu, launch_guard, poisoned, randn
from moe_lora_testing import (
    check_delta,
    check_sentinel_stage,
    cpu_weights,
    enabled_of,
    handled,
    make_pool,
    named_routing,
    run_delta,
    stage_inputs,
    twin_delta,
)

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import KernelPreconditionError
from moelora_core.align import AlignOutput
from moelora_kernels import (
    STAGES,
    MoELoRAInputs,
    fused_moe,
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_align_block_size,
    moe_block_m,
    moe_lora_align_block_size,
    stage_tensors,
)
from moelora_reference import moe_lora_ops as twin
from moelora_reference.oracle import moe_lora_forward

pytestmark = pytest.mark.interpreter

LORA_CASES = moe_lora_cases(kinds=("extend", "decode", "mixed", "idle"), virtual_experts=False)
# the fp64 loop oracle cannot follow the gpu profile's sizes
ORACLE_CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


# path drawn with the case (fused kernel, pair): no extra examples
PATHS = {"fused": True, "pair": False}


@given(case=LORA_CASES, stage=st.sampled_from(STAGES), path=st.sampled_from(sorted(PATHS)))
def test_moe_lora_delta_matches_twin(case, stage, path):
    fused = PATHS[path]
    c = case.materialize(DEVICE)
    spec, w = c.spec, c.lora
    M, k = c.topk_ids.shape
    gen = torch.Generator().manual_seed(case.seed)
    enabled = enabled_of(c.token_lora_mapping, spec.max_loras)
    bm = moe_block_m(M, k, spec.E, spec.max_loras)
    with launch_guard():
        align = moe_lora_align_block_size(c.topk_ids, c.token_lora_mapping, spec.E, bm, spec.max_loras, enabled)
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, c.x.dtype, c.topk_weights)
    out = run_delta(stage, x, out0.clone(), w, align, k, tw, enabled, fused)
    want = twin_delta(stage, x, out0, w, align, k, tw, enabled)
    mask = handled(stage, c.topk_ids, c.token_lora_mapping, enabled, stage_tensors(w, stage)["ranks"], spec.E)
    check_delta(stage, out, want, out0, mask, c.x.dtype, case.seed, f"{stage} path={path}")


@given(case=LORA_CASES, stage=st.sampled_from(STAGES))
def test_shrink_intermediate_matches_twin(case, stage):
    c = case.materialize(DEVICE)
    spec, w = c.spec, c.lora
    M, k = c.topk_ids.shape
    gen = torch.Generator().manual_seed(case.seed)
    bm = moe_block_m(M, k, spec.E, spec.max_loras)
    with launch_guard():
        align = moe_lora_align_block_size(c.topk_ids, c.token_lora_mapping, spec.E, bm, spec.max_loras)
    x, _, _ = stage_inputs(gen, stage, M, k, spec.H, spec.I, c.x.dtype, None)
    t = stage_tensors(w, stage)
    S = 2 if stage == "gate_up" else 1
    inter = poisoned(S, M * k, spec.R, dtype=c.x.dtype)
    with launch_guard():
        fused_moe_lora_shrink(x, t["lora_a"], align, stage=stage, top_k=k, ranks=t["ranks"], out=inter)
    want = twin.fused_moe_lora_shrink(x, t["lora_a"], align, stage=stage, top_k=k, ranks=t["ranks"]).cpu()
    ones = torch.ones(spec.max_loras, dtype=torch.int32)
    mask = handled(stage, c.topk_ids, c.token_lora_mapping, ones, t["ranks"], spec.E)
    got = inter.cpu()
    assert_close(got[mask], want[mask], dtype=c.x.dtype, what=f"{stage} intermediate", seed=case.seed)
    assert bool(got[~mask].isnan().all()), f"intermediate rows of unhandled pairs written (seed={case.seed})"


@given(case=moe_lora_cases(ORACLE_CAPS, kinds=("extend", "decode", "mixed"), virtual_experts=False, dtype=torch.float32))
def test_layer_with_lora_matches_oracle(case):
    c = case.materialize(DEVICE)
    spec = c.spec
    M, k = c.topk_ids.shape
    with launch_guard():
        align = moe_lora_align_block_size(c.topk_ids, c.token_lora_mapping, spec.E,
                                          moe_block_m(M, k, spec.E, spec.max_loras), spec.max_loras)
        y = fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down,
                      deltas=MoELoRAInputs(c.lora, align))
    want = moe_lora_forward(cpu(c.x), cpu(c.topk_ids), cpu(c.topk_weights), cpu(c.base.w_gate_up),
                            cpu(c.base.w_down), cpu_weights(c.lora), cpu(c.token_lora_mapping))
    assert_close(y, want, dtype=torch.float32, what="layer with LoRA vs oracle", seed=case.seed)


# --- named cases -----------------------------------------------------------------------------------


def named_problem(seed, w, M, k, ids=None, mapping=None, block_m=32):
    spec = w.spec
    gen, ids, mapping = named_routing(seed, spec, M, k, ids, mapping)
    tw = torch.rand(M, k, generator=gen).to(DEVICE)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, spec.E, block_m, spec.max_loras)
    return gen, ids, mapping, tw, align


def check_named(seed, w, stage, M, k, ids=None, mapping=None, enabled=None, fused=True, what="", max_rank=None,
                align_enabled=False):
    gen, ids, mapping, tw, align = named_problem(seed, w, M, k, ids, mapping)
    spec = w.spec
    if enabled is None:
        enabled = enabled_of(mapping, spec.max_loras)
    if align_enabled:
        with launch_guard():
            align = moe_lora_align_block_size(ids, mapping, spec.E, 32, spec.max_loras, enabled)
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, spec.dtype, tw)
    out = run_delta(stage, x, out0.clone(), w, align, k, tw, enabled, fused, max_rank)
    want = twin_delta(stage, x, out0, w, align, k, tw, enabled, max_rank)
    mask = handled(stage, ids, mapping, enabled, stage_tensors(w, stage)["ranks"], spec.E)
    check_delta(stage, out, want, out0, mask, spec.dtype, seed, what)
    return x, out0, out, align, ids, mapping, tw, enabled


@pytest.mark.parametrize("fused", [True, False])
def test_gate_A_differs_from_up_A(fused):
    # a kernel that reads gate's A (or B) for the up slice passes only if the two are equal
    w = make_pool(20, L=2)
    x, out0, out, align, _, _, _, enabled = check_named(20, w, "gate_up", 24, 2, fused=fused,
                                                                what="gate_A != up_A")
    wrong = cpu_weights(w)
    wrong.gate_up_A[1].copy_(wrong.gate_up_A[0])
    t = stage_tensors(wrong, "gate_up")
    swapped = twin.fused_moe_lora(cpu(x), t["lora_a"], t["lora_b"], cpu(align), cpu(out0).clone(), stage="gate_up",
                                  top_k=2, ranks=t["ranks"], scalings=t["scalings"], adapter_enabled=cpu(enabled))
    assert not torch.allclose(out.cpu().float(), swapped.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_rank", [None, 16, 12])
def test_rank_below_R_and_mixed_ranks(dtype, max_rank):
    # slot 0: gate r3, up r12, down r7; slot 1: rank 1 everywhere; slot 2: up absent (rank 0)
    ranks = {0: {"gate": 3, "up": 12, "down": 7}, 1: {"gate": 1, "up": 1, "down": 1}, 2: {"gate": 9, "down": 2}}
    w = make_pool(21, ranks=ranks, dtype=dtype)
    for stage in STAGES:
        for fused in (True, False):
            check_named(21, w, stage, 40, 2, fused=fused, what=f"mixed ranks {stage} fused={fused}",
                        max_rank=max_rank)


@pytest.mark.parametrize("stage", STAGES)
def test_pair_with_mixed_ranks_disabled_slot_and_sentinel_ids(stage):
    # the shrink/expand pair with a host max_rank: slot 1 disabled, slot 2 has no up module; ids -1,
    # E and E+1 among the routes
    ranks = {0: {"gate": 3, "up": 12, "down": 7}, 1: {"gate": 5, "up": 5, "down": 5}, 2: {"gate": 9, "down": 2}}
    w = make_pool(29, ranks=ranks, dtype=torch.float16)
    E = w.spec.E
    ids = torch.tensor([[-1, 0], [E, 1], [E + 1, 4], [2, E], [4, 3], [1, 2], [0, 3]] * 5, dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, 0, 2, -1, 0] * 5, dtype=torch.int32)
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    check_named(29, w, stage, 35, 2, ids=ids, mapping=mapping, enabled=enabled, fused=False, max_rank=12,
                what=f"pair {stage}")


def test_expand_refuses_an_intermediate_of_another_shape_or_dtype():
    w = make_pool(30, L=2, R=8)
    _, _, _, tw, align = named_problem(30, w, 6, 2)
    t = stage_tensors(w, "down")
    out = torch.zeros(6, 2, w.spec.H, device=DEVICE)
    # [S, M·top_k, R] in the factors' dtype only (a 4-D stack of fp32 partials is no intermediate)
    for bad, match in ((torch.zeros(2, 1, 12, 8, device=DEVICE), "intermediate"),
                       (torch.zeros(1, 12, 8, dtype=torch.float16, device=DEVICE), "lora_b: dtype")):
        with pytest.raises(KernelPreconditionError, match=match):
            fused_moe_lora_expand(bad, t["lora_b"], align, out, stage="down", top_k=2, ranks=t["ranks"],
                                  scalings=t["scalings"], topk_weights=tw)
    assert bool((out == 0).all())


def test_max_rank_above_R_is_refused():
    w = make_pool(22, L=1, R=8)
    with pytest.raises(KernelPreconditionError, match="max_rank: rank 9 > the pool's max rank R=8"):
        check_named(22, w, "gate_up", 4, 2, max_rank=9)


@pytest.mark.parametrize("stage", STAGES)
def test_max_rank_below_a_loaded_slots_rank_is_refused(stage):
    # Regression: max_rank=4 with a rank-8 slot silently cut its rank loop.
    # moe_lora_delta has the pool, so it checks max_rank against every loaded slot's host rank.
    ranks = {0: {"gate": 3, "up": 8, "down": 6}, 1: {"gate": 2, "up": 2, "down": 2}}
    w = make_pool(25, L=2, R=16, ranks=ranks)
    need = 8 if stage == "gate_up" else 6
    with pytest.raises(KernelPreconditionError, match=f"max_rank: {need - 1} < rank {need} of slot 0"):
        check_named(25, w, stage, 6, 2, max_rank=need - 1)
    check_named(25, w, stage, 6, 2, max_rank=need, what=f"max_rank = the largest {stage} rank")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_base_tokens_bit_identical_in_a_mixed_batch(dtype):
    # same kernels with and without LoRA: rows of NO_ADAPTER tokens must not change by a bit
    w = make_pool(23, dtype=dtype)
    spec = w.spec
    M, k, E_base = 37, 2, spec.E + 1
    gen, ids, mapping, tw, align = named_problem(23, w, M, k)
    x = randn(gen, M, spec.H, dtype=dtype)
    w_gu = randn(gen, E_base, 2 * spec.I, spec.H, dtype=dtype, scale=1 / math.sqrt(spec.H))
    w_d = randn(gen, E_base, spec.H, spec.I, dtype=dtype, scale=1 / math.sqrt(spec.I))
    base_align = moe_align_block_size(ids, E_base, 32)
    with launch_guard():
        plain = fused_moe(x, ids, tw, w_gu, w_d, align=base_align)
        with_lora = fused_moe(x, ids, tw, w_gu, w_d, align=base_align, deltas=MoELoRAInputs(w, align))
    base_rows = (mapping == -1).cpu()
    assert base_rows.any() and (~base_rows).any()
    assert_bitwise_equal(with_lora.cpu()[base_rows], plain.cpu()[base_rows], what="base rows")
    assert not torch.equal(with_lora.cpu()[~base_rows], plain.cpu()[~base_rows])


@pytest.mark.parametrize("align_enabled", [True, False])
@pytest.mark.parametrize("stage", STAGES)
def test_disabled_slot_leaves_its_rows_bit_identical(stage, align_enabled):
    # slot 1 is used by the mapping but disabled: the kernels exit early for it (the alignment too,
    # when it is given adapter_enabled; the kernel's own check otherwise)
    w = make_pool(24)
    mapping = torch.tensor([0, 1, 1, 2, -1, 1, 0, 2] * 4, dtype=torch.int32)
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    for fused in (True, False):
        check_named(24, w, stage, 32, 2, mapping=mapping, enabled=enabled, fused=fused, align_enabled=align_enabled,
                    what=f"disabled slot {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_expert_ids_minus_one_E_and_beyond_add_nothing(stage):
    # -1: expert parallelism; E, E+1: extra fused base experts without LoRA
    w = make_pool(25)
    E = w.spec.E
    ids = torch.tensor([[-1, 0], [E, 1], [E + 1, -1], [2, E], [4, 3]] * 5, dtype=torch.int32)
    mapping = torch.tensor([0, 1, 2, 0, 1] * 5, dtype=torch.int32)
    check_named(25, w, stage, 25, 2, ids=ids, mapping=mapping, what=f"sentinel ids {stage}")


@pytest.mark.parametrize("name, M, k, ids, mapping", [
    ("single token", 1, 2, None, torch.tensor([2], dtype=torch.int32)),                       # T < BLOCK_M
    ("all tokens to one expert", 70, 1, torch.full((70, 1), 3, dtype=torch.int32), torch.zeros(70, dtype=torch.int32)),
    ("empty experts", 30, 2, torch.tensor([[0, 4]] * 30, dtype=torch.int32), None),          # experts 1-3 empty
    ("top_k = 1", 33, 1, None, None),
])
@pytest.mark.parametrize("stage", STAGES)
def test_named_routing_cases(name, M, k, ids, mapping, stage):
    w = make_pool(26, dtype=torch.float16)
    for fused in (True, False):
        check_named(26, w, stage, M, k, ids=ids, mapping=mapping, fused=fused, what=f"{name} {stage}")


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("stage", STAGES)
def test_five_slots_of_uneven_blocks(stage, path):
    # L = 5, not a power of two (BLOCK_L 8: three masked lanes in the flat grid's count load); slot 0
    # empty, slot 1 crowded over every expert, slot 2 disabled though tokens map to it, slot 3 one
    # token (two blocks), slot 4 crowded; base tokens, and ids -1 and E among the routes
    w = make_pool(41, L=5, E=6)
    E = w.spec.E
    M, k = 40, 2
    gen = torch.Generator().manual_seed(41)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    ids[3, 0], ids[7, 1] = -1, E
    mapping = torch.tensor([1] * 17 + [2] * 5 + [3] + [4] * 12 + [-1] * 5, dtype=torch.int32)
    enabled = torch.tensor([0, 1, 0, 1, 1], dtype=torch.int32, device=DEVICE)
    _, ids, mapping = named_routing(41, w.spec, M, k, ids, mapping)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, E, 16, 5, enabled)
    blocks = (align.num_tokens_post_padded.cpu() // 16).tolist()
    assert blocks[0] == blocks[2] == 0 and blocks[3] == 2 and blocks[1] > 2 and blocks[4] > 2, blocks
    out, out0 = check_sentinel_stage(path, stage, w, ids, mapping, enabled, align, 41, f"five slots {path} {stage}")
    assert not torch.equal(out.cpu(), out0.cpu()), "the delta added nothing"


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("stage", STAGES)
def test_every_pair_in_its_own_group_fills_the_grid_bounds(stage, path):
    # 15 pairs, each its own (slot, expert) group: 5 used blocks per slot, the host's per-slot bound
    # num_pairs // BLOCK_M + min(E, num_pairs), and 15 in all, the flat grid's bound
    # num_pairs // BLOCK_M + min(E · L, num_pairs): a bound one too small drops a block
    w = make_pool(42, L=3, E=5)
    ids = torch.tensor([[e] for e in range(5)] * 3, dtype=torch.int32, device=DEVICE)
    mapping = torch.tensor([s for s in range(3) for _ in range(5)], dtype=torch.int32, device=DEVICE)
    enabled = torch.ones(3, dtype=torch.int32, device=DEVICE)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, 5, 16, 3, enabled)
    blocks, pairs = (align.num_tokens_post_padded.cpu() // 16).tolist(), 15
    assert blocks == [pairs // 16 + min(5, pairs)] * 3 and sum(blocks) == pairs // 16 + min(5 * 3, pairs), blocks
    check_sentinel_stage(path, stage, w, ids, mapping, enabled, align, 42, f"own groups {path} {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_idle_batch_changes_nothing(stage):
    # IDLE: zero tokens launch nothing; replayed on graph buffers (capacity 8, every token -1) the
    # kernels run and every program exits early
    w = make_pool(27)
    for M in (0, 8):
        ids = torch.zeros(M, 2, dtype=torch.int32)
        mapping = torch.full((M,), -1, dtype=torch.int32)
        check_named(27, w, stage, M, 2, ids=ids, mapping=mapping, what=f"idle M={M} {stage}")


def _bad_call(**override):
    w = make_pool(28, L=2, R=8)
    _, _, _, tw, align = named_problem(28, w, 6, 2)
    t = stage_tensors(w, "down")
    args = {"x": torch.randn(12, w.spec.I, device=DEVICE), "lora_a": t["lora_a"], "lora_b": t["lora_b"],
            "align": align, "out": torch.zeros(6, 2, w.spec.H, device=DEVICE), "stage": "down", "top_k": 2,
            "ranks": t["ranks"], "scalings": t["scalings"], "topk_weights": tw}
    args.update(override)
    x, a, b, al, out = (args.pop(n) for n in ("x", "lora_a", "lora_b", "align", "out"))
    fused_moe_lora(x, a, b, al, out, **args)


@pytest.mark.parametrize("override, match", [
    ({"stage": "up"}, "stage"),
    ({"topk_weights": None}, "router-weighted"),
    ({"x": torch.randn(12, 24).half()}, "lora_a: dtype"),
    ({"x": torch.randn(11, 24)}, "multiple of top_k"),
    ({"out": torch.zeros(6, 2, 39)}, "out: expected"),
    ({"out": torch.zeros(6, 40, 2).transpose(1, 2)}, "stride 1"),
    ({"ranks": torch.zeros(2, dtype=torch.int64)}, "ranks: dtype"),
    ({"scalings": torch.zeros(3)}, "scalings: expected shape"),
    ({"max_rank": 9}, "max_rank"),
    ({"align": AlignOutput(torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32),
                           torch.zeros(2, dtype=torch.int32))}, "64 rows per slot < capacity 96"),
    ({"align": AlignOutput.empty(3, 6, 2, 5, 32, "cpu")}, "shape"),
    ({"lora_b": torch.zeros(2, 5, 40, 4)}, "does not pair"),
])
def test_launcher_refuses_bad_arguments(override, match):
    override = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else
                (AlignOutput(*(t.to(DEVICE) for t in v)) if isinstance(v, AlignOutput) else v)
                for k, v in override.items()}
    with pytest.raises(KernelPreconditionError, match=match):
        _bad_call(**override)

