"""``moe_lora_align_block_size`` / ``moe_align_block_size`` kernels against the contract and the twin.

Covers: drawn problems (graph tails, disabled slots, sentinel and extra-expert ids, BLOCK_M 16–64)
checked by the twin's contract checker on buffers poisoned with stale garbage, and equal to the
twin once each block's rows are sorted (order within an expert is free), with one or several
programs per slot (``ALIGN_SPLIT``, drawn); the base variant; buffers larger than the capacity (a
larger graph bucket); a replay after a larger batch (also split); a single token; all tokens to one
expert; an empty batch; more programs than pairs; launcher precondition errors (a bad split, a
workspace of the wrong shape among them).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, ON_GPU, cpu, launch_guard, poisoned_align

from moelora_conformance.strategies import align_problems
from moelora_core import KernelPreconditionError, align_capacity, assert_exact
from moelora_core.align import AlignOutput
from moelora_kernels import moe_align_block_size, moe_lora_align_block_size
from moelora_kernels.align import align_workspace_shape
from moelora_reference.align import check_alignment
from moelora_reference.align import moe_lora_align_block_size as align_twin

pytestmark = pytest.mark.interpreter


def _canonical(out: AlignOutput, block_m: int) -> torch.Tensor:
    """sorted_token_ids with the rows of each expert's run of blocks sorted: the order within an
    expert is free, and an expert with several blocks may spread its pairs over them in any order."""
    rows = out.sorted_token_ids.cpu().clone()
    experts = out.expert_ids.cpu().tolist()
    for slot, blocks in enumerate(experts):
        b = 0
        while b < len(blocks):
            end = b + 1
            while end < len(blocks) and blocks[end] == blocks[b] and blocks[b] >= 0:
                end += 1
            span = slice(b * block_m, end * block_m)
            rows[slot, span] = rows[slot, span].sort().values
            b = end
    return rows


def _assert_same_as_twin(out, ids, mapping, enabled, E, block_m, L, seed):
    check_alignment(cpu(out), cpu(ids), cpu(mapping), E, block_m, L, cpu(enabled), seed=seed)
    want = align_twin(cpu(ids), cpu(mapping), E, block_m, L, cpu(enabled))
    assert_exact(out.num_tokens_post_padded, want.num_tokens_post_padded, what="num_tokens_post_padded", seed=seed)
    assert_exact(out.expert_ids, want.expert_ids, what="expert_ids", seed=seed)
    assert_exact(_canonical(out, block_m), _canonical(want, block_m), what="sorted_token_ids (per block)", seed=seed)


def _run(ids, mapping, enabled, E, block_m, L, out=None, split=None):
    M, k = ids.shape
    if out is None:
        out = poisoned_align(L, align_capacity(M, k, E, block_m), block_m)
    config = None if split is None else {"ALIGN_SPLIT": split}
    workspace = None
    if split is not None:
        # stale garbage in the scratch too: every histogram and cursor must be written before use
        workspace = torch.full(align_workspace_shape(L, E, split), 0x3FFF_FFFF, dtype=torch.int32, device=DEVICE)
    with launch_guard():
        return moe_lora_align_block_size(ids, mapping, E, block_m, L, enabled, out=out, workspace=workspace,
                                         config=config)


# ALIGN_SPLIT drawn with the problem: the split kernels cost no extra examples
@given(problem=align_problems(), split=st.sampled_from([1, 2, 4, 8]))
def test_alignment_meets_contract_and_twin(problem, split):
    ids, mapping, enabled = problem.materialize(DEVICE)
    out = _run(ids, mapping, enabled, problem.num_experts, problem.block_m, problem.max_loras, split=split)
    _assert_same_as_twin(out, ids, mapping, enabled, problem.num_experts, problem.block_m, problem.max_loras,
                         problem.seed)


@given(problem=align_problems(), split=st.sampled_from([1, 4]))
def test_base_alignment_groups_every_pair_with_a_valid_id(problem, split):
    """The base MoE's variant: one slot, no mapping, every id in [0, E_base) is a real expert."""
    ids, _, _ = problem.materialize(DEVICE)
    M, k = ids.shape
    E_base = problem.routing.num_base_experts
    out = poisoned_align(1, align_capacity(M, k, E_base, problem.block_m), problem.block_m)
    with launch_guard():
        moe_align_block_size(ids, E_base, problem.block_m, out=out, config={"ALIGN_SPLIT": split})
    zeros = torch.zeros(M, dtype=torch.int32, device=DEVICE)
    _assert_same_as_twin(out, ids, zeros, None, E_base, problem.block_m, 1, problem.seed)


def test_buffer_larger_than_capacity_is_padded_to_its_end():
    # a graph bucket sized for more tokens than this batch: every extra row is padding
    gen = torch.Generator().manual_seed(1)
    M, k, E, L, bm = 5, 2, 4, 2, 16
    ids = torch.randint(0, E, (M, k), generator=gen, dtype=torch.int32).to(DEVICE)
    mapping = torch.tensor([0, 1, -1, 0, 1], dtype=torch.int32, device=DEVICE)
    rows = align_capacity(M, k, E, bm) + 4 * bm
    out = _run(ids, mapping, None, E, bm, L, out=poisoned_align(L, rows, bm))
    cap = align_capacity(M, k, E, bm)
    trimmed = AlignOutput(out.sorted_token_ids[:, :cap], out.expert_ids[:, :cap // bm], out.num_tokens_post_padded)
    _assert_same_as_twin(trimmed, ids, mapping, None, E, bm, L, seed=1)
    assert bool((out.sorted_token_ids[:, cap:] == M * k).all())
    assert bool((out.expert_ids[:, cap // bm:] == -1).all())


@pytest.mark.parametrize("split", [None, 4])
def test_replay_after_a_larger_batch_leaves_nothing_stale(split):
    gen = torch.Generator().manual_seed(2)
    M, k, E, L, bm = 40, 2, 6, 3, 16
    out = poisoned_align(L, align_capacity(M, k, E, bm), bm)
    big = torch.randint(0, E, (M, k), generator=gen, dtype=torch.int32).to(DEVICE)
    _run(big, torch.randint(0, L, (M,), generator=gen, dtype=torch.int32).to(DEVICE), None, E, bm, L, out=out,
         split=split)
    # same capacity, now only 3 live tokens (graph tail mapped to -1, stale routing kept)
    mapping = torch.full((M,), -1, dtype=torch.int32, device=DEVICE)
    mapping[:3] = torch.tensor([2, -1, 2], dtype=torch.int32)
    _run(big, mapping, None, E, bm, L, out=out, split=split)
    _assert_same_as_twin(out, big, mapping, None, E, bm, L, seed=2)


def test_split_alignment_equals_one_program_per_slot_exactly():
    # parts are placed in order and the interpreter's atomics in pair order, so every split gives
    # the single program's rows exactly (on a GPU only up to order within an expert); one expert
    # spans several blocks and the pairs of each part, with a disabled slot and graph-tail tokens
    gen = torch.Generator().manual_seed(4)
    M, k, E, L, bm = 50, 2, 5, 3, 16
    ids = torch.randint(-1, E + 2, (M, k), generator=gen, dtype=torch.int32)
    ids[:30, 0] = 2
    mapping = torch.randint(-1, L, (M,), generator=gen, dtype=torch.int32)
    enabled = torch.tensor([1, 1, 0], dtype=torch.int32)
    ids, mapping, enabled = ids.to(DEVICE), mapping.to(DEVICE), enabled.to(DEVICE)
    one = _run(ids, mapping, enabled, E, bm, L, split=1)
    for split in (4, 32):  # 32 programs for 100 pairs of 4: the last 7 parts are empty
        out = _run(ids, mapping, enabled, E, bm, L, split=split)
        if ON_GPU:  # the GPU's atomics order each part's pairs freely
            out = AlignOutput(_canonical(out, bm), out.expert_ids.cpu(), out.num_tokens_post_padded.cpu())
            one_rows = AlignOutput(_canonical(one, bm), one.expert_ids.cpu(), one.num_tokens_post_padded.cpu())
        else:
            one_rows = one
        for name, a, b in zip(AlignOutput._fields, out, one_rows):
            assert_exact(a, b, what=f"{name} ALIGN_SPLIT={split}", seed=4)
    _assert_same_as_twin(one, ids, mapping, enabled, E, bm, L, seed=4)


@pytest.mark.parametrize("case", ["single_token", "one_expert", "empty_batch", "top_k_1", "all_base"])
def test_named_cases(case):
    gen = torch.Generator().manual_seed(3)
    E, L, bm = 8, 2, 32
    if case == "single_token":  # T < BLOCK_M
        ids, mapping = torch.tensor([[3, 5]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    elif case == "one_expert":  # all tokens to one expert: several blocks of the same expert
        ids, mapping = torch.full((70, 1), 6, dtype=torch.int32), torch.zeros(70, dtype=torch.int32)
    elif case == "empty_batch":  # IDLE: zero rows, every slot empty
        ids, mapping = torch.zeros((0, 2), dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    elif case == "top_k_1":
        ids = torch.randint(-1, E + 1, (33, 1), generator=gen, dtype=torch.int32)
        mapping = torch.randint(-1, L, (33,), generator=gen, dtype=torch.int32)
    else:  # only NO_ADAPTER tokens: nothing to align
        ids, mapping = torch.randint(0, E, (9, 2), generator=gen, dtype=torch.int32), torch.full((9,), -1, dtype=torch.int32)
    ids, mapping = ids.to(DEVICE), mapping.to(DEVICE)
    out = _run(ids, mapping, None, E, bm, L)
    _assert_same_as_twin(out, ids, mapping, None, E, bm, L, seed=3)


def test_int64_ids_beyond_int32_are_skipped_not_wrapped():
    # an int64 id of 2**32 + 1 must not be read as expert 1
    ids = torch.tensor([[2**32 + 1, 1]], dtype=torch.int64, device=DEVICE)
    mapping = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    out = _run(ids, mapping, None, 4, 16, 1)
    assert out.sorted_token_ids[0, :16].tolist() == [1] + [2] * 15
    assert out.expert_ids[0, :2].tolist() == [1, -1]


@pytest.mark.parametrize("call, match", [
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 24, 2), "power of two"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 8, 2), "block_m"),
    (lambda ids, m: moe_lora_align_block_size(ids.to(torch.int16), m, 4, 16, 2), "topk_ids: dtype"),
    (lambda ids, m: moe_lora_align_block_size(ids, m[:-1], 4, 16, 2), "token_lora_mapping: expected shape"),
    (lambda ids, m: moe_lora_align_block_size(ids.t(), m[:2], 4, 16, 2), "contiguous"),
    (lambda ids, m: moe_lora_align_block_size(ids, m.long(), 4, 16, 2), "token_lora_mapping: dtype"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 16, 2, torch.ones(3, dtype=torch.int32, device=DEVICE)),
     "adapter_enabled"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 16, 2, out=AlignOutput.empty(2, 1, 2, 4, 16, DEVICE)),
     "capacity"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 0, 16, 2), "num_experts"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 16, 2, config={"ALIGN_SPLIT": 3}), "ALIGN_SPLIT"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 16, 2, config={"ALIGN_SPLIT": 128}), "ALIGN_SPLIT"),
    (lambda ids, m: moe_lora_align_block_size(ids, m, 4, 16, 2, config={"ALIGN_SPLIT": 2},
                                              workspace=torch.zeros(2, 2, 1, 16, dtype=torch.int32, device=DEVICE)),
     "workspace: expected shape"),
])
def test_launcher_refuses_bad_arguments(call, match):
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    mapping = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match=match):
        call(ids, mapping)
