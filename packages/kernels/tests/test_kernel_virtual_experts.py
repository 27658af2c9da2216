"""Virtual experts: the id kernel against its twin, and the delta through the base GEMM against the
MoE-LoRA twin.

Covers: drawn routing with sentinels (-1, ids in [E, E_base)), NO_ADAPTER tokens and slots beyond
the mapping; the virtual delta of both stages equal to the per-slot twin's within tolerance and
rows without LoRA bit-identical; named cases: id E of slot s never becomes expert 0 of slot s + 1,
the [L, E, ...] buffers are used as [L·E, ...] views (no copy), launcher precondition errors.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_bitwise_equal, cpu, launch_guard
from moe_lora_testing import check_delta, enabled_of, handled, make_pool, stage_inputs

from moelora_conformance.strategies import align_problems, moe_lora_cases
from moelora_core import KernelPreconditionError, assert_exact
from moelora_kernels import STAGES, moe_lora_align_block_size, stage_tensors, virtual_align, virtual_moe_lora_delta
from moelora_kernels import virtual_topk_ids as virtual_ids_kernel
from moelora_reference import moe_lora_ops as twin
from moelora_reference.virtual_experts import virtual_topk_ids as virtual_ids_twin

pytestmark = pytest.mark.interpreter


@given(problem=align_problems())
def test_virtual_ids_match_twin(problem):
    ids, mapping, _ = problem.materialize(DEVICE)
    out = torch.full(ids.shape, 0x7FFF, dtype=torch.int32, device=DEVICE)
    with launch_guard():
        virtual_ids_kernel(ids, mapping, problem.num_experts, out=out)
    assert_exact(out, virtual_ids_twin(cpu(ids), cpu(mapping), problem.num_experts), what="virtual ids",
                 seed=problem.seed)


def test_sentinels_stay_sentinels():
    E = 4
    ids = torch.tensor([[4, -1], [3, 5], [0, 2]], dtype=torch.int32, device=DEVICE)  # 4 = E: slot 0's extra expert
    mapping = torch.tensor([0, 1, -1], dtype=torch.int32, device=DEVICE)
    with launch_guard():
        out = virtual_ids_kernel(ids, mapping, E)
    assert out.tolist() == [[-1, -1], [7, -1], [-1, -1]]


@given(case=moe_lora_cases(kinds=("extend", "decode", "mixed"), virtual_experts=True), stage=st.sampled_from(STAGES))
def test_virtual_delta_matches_per_slot_twin(case, stage):
    c = case.materialize(DEVICE)
    spec, w = c.spec, c.lora
    M, k = c.topk_ids.shape
    gen = torch.Generator().manual_seed(case.seed)
    with launch_guard():
        _, valign = virtual_align(c.topk_ids, c.token_lora_mapping, spec.E, spec.max_loras)
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, c.x.dtype, c.topk_weights)
    out = out0.clone()
    with launch_guard():
        virtual_moe_lora_delta(stage, x, out, w, valign, top_k=k, topk_weights=tw)
    # the per-slot twin on its own alignment: the same math, another grouping
    align = moe_lora_align_block_size(c.topk_ids, c.token_lora_mapping, spec.E, 32, spec.max_loras)
    t = stage_tensors(w, stage)
    want = twin.fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out0.clone(), stage=stage, top_k=k,
                               ranks=t["ranks"], scalings=t["scalings"], topk_weights=tw)
    ones = torch.ones(spec.max_loras, dtype=torch.int32)
    # a rank-0 module adds an exact +0.0 through the virtual path (zero factors, σ 0): its rows
    # stay bit-identical like those of NO_ADAPTER tokens and sentinel ids
    mask = handled(stage, c.topk_ids, c.token_lora_mapping, ones, t["ranks"], spec.E)
    check_delta(stage, out, want, out0, mask, c.x.dtype, case.seed, f"virtual {stage}")


def test_virtual_path_reads_the_pool_buffers_in_place():
    # the [L, E, R, H] stacks are viewed as [L*E, R, H]: a change to the pool shows at once
    w = make_pool(30, L=2)
    ids = torch.tensor([[1, 3]] * 4, dtype=torch.int32, device=DEVICE)
    mapping = torch.tensor([1, 1, 0, -1], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(30)
    x, out0, _ = stage_inputs(gen, "gate_up", 4, 2, w.spec.H, w.spec.I, torch.float32, None)
    with launch_guard():
        _, valign = virtual_align(ids, mapping, w.spec.E, 2)
        first = virtual_moe_lora_delta("gate_up", x, out0.clone(), w, valign, top_k=2)
    w.gate_up_B[1, 1, 3].mul_(2.0)  # slot 1, expert 3, up slice
    with launch_guard():
        second = virtual_moe_lora_delta("gate_up", x, out0.clone(), w, valign, top_k=2)
    rows_changed = (first != second).any(dim=-1)
    assert rows_changed.nonzero().tolist() == [[0, 1], [1, 1]]  # the (token, k) pairs of slot 1, expert 3
    assert_bitwise_equal(first[~rows_changed], second[~rows_changed], what="rows of other (slot, expert) pairs")


@pytest.mark.parametrize("call, match", [
    (lambda w, x, o, a: virtual_moe_lora_delta("down", x, o, w, a, top_k=2), "router-weighted"),
    (lambda w, x, o, a: virtual_moe_lora_delta("gate_up", x, o, w, a, top_k=2,
                                               topk_weights=torch.ones(3, 2, device=DEVICE)), "not router-weighted"),
    (lambda w, x, o, a: virtual_moe_lora_delta("gate", x, o, w, a, top_k=2), "stage"),
    (lambda w, x, o, a: virtual_moe_lora_delta("gate_up", x, o[:, :, :-1], w, a, top_k=2), "out"),
    (lambda w, x, o, a: virtual_ids_kernel(torch.zeros(3, 2, device=DEVICE), torch.zeros(3, dtype=torch.int32,
                                                                                          device=DEVICE), 4), "dtype"),
    (lambda w, x, o, a: virtual_ids_kernel(torch.zeros(3, 2, dtype=torch.int32, device=DEVICE),
                                           torch.zeros(3, dtype=torch.int32, device=DEVICE), 2**20,
                                           max_loras=2**12), "overflow"),
])
def test_launcher_refuses_bad_arguments(call, match):
    w = make_pool(31, L=2)
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32, device=DEVICE)
    mapping = torch.tensor([0, 1, -1], dtype=torch.int32, device=DEVICE)
    _, valign = virtual_align(ids, mapping, w.spec.E, 2)
    x = torch.randn(3, w.spec.H, device=DEVICE)
    out = torch.zeros(3, 2, 2 * w.spec.I, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match=match):
        call(w, x, out, valign)


def test_enabled_helper_agrees_with_twin():
    # the test helper that builds adapter_enabled is itself checked against the reference rule
    from moelora_reference.mapping import adapter_enabled
    mapping = torch.tensor([2, -1, 0, 2], dtype=torch.int32)
    assert_exact(enabled_of(mapping, 4), adapter_enabled(mapping, 4), what="adapter_enabled helper")


@pytest.mark.parametrize("stage", STAGES)
def test_slot_without_the_module_keeps_negative_zero(stage):
    # H200 gpu profile, 2026-11-29: an fp16 output holding -0.0 in a row of a slot whose adapter lacks
    # the stage's modules came back +0.0 (the expand added σ·0 = +0.0). Such rows must stay
    # bit-identical, -0.0 included, like rows of NO_ADAPTER tokens.
    w = make_pool(32, L=2, ranks={1: {"gate": 16, "up": 16, "down": 16}})  # slot 0 holds no module
    M, k = 6, 2
    ids = torch.tensor([[0, 3], [1, 2], [4, 0], [2, 2], [3, 1], [0, 4]], dtype=torch.int32, device=DEVICE)
    mapping = torch.tensor([0, 0, 0, 1, 1, -1], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(32)
    tw = torch.rand(M, k, generator=gen).to(DEVICE) if stage == "down" else None
    x, out0, tw = stage_inputs(gen, stage, M, k, w.spec.H, w.spec.I, torch.float32, tw)
    out0[:3] = -0.0  # every element of slot 0's rows is negative zero
    with launch_guard():
        _, valign = virtual_align(ids, mapping, w.spec.E, 2)
        out = virtual_moe_lora_delta(stage, x, out0.clone(), w, valign, top_k=k, topk_weights=tw)
    assert_bitwise_equal(out[:3], out0[:3], what=f"{stage}: rows of the slot without the module")
    assert torch.signbit(out[:3]).all()
    assert (out[3:5] != out0[3:5]).any(), "slot 1's rows must receive a delta"
