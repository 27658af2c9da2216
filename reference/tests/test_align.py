"""The readable ``moe_lora_align_block_size`` twin and the contract checker ``check_alignment``.

Covers: named cases with exact outputs (T < BLOCK_M, all tokens to one expert, empty experts, ids -1
and E, a single token, top_k = 1, disabled slots, base tokens mixed in, graph-capacity tails, IDLE);
refusals of malformed inputs; the checker accepting every legal reordering (experts, rows within an
expert) and rejecting each kind of corruption with coordinates, disabled slots skipped only when
told; Hypothesis: the twin passes the
checker and equals an independent sort-based formulation exactly.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import align_problems, capped
from moelora_core import AlignOutput, InvalidFieldError, align_capacity, assert_exact
from moelora_reference.align import check_alignment, moe_lora_align_block_size

I32 = torch.int32


# The float64 loop oracle and the loop twins run on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def ids_(rows):
    return torch.tensor(rows, dtype=I32)


def align_and_check(ids, mapping, E, bm, L, enabled=None):
    out = moe_lora_align_block_size(ids, mapping, E, bm, L, enabled)
    check_alignment(out, ids, mapping, E, bm, L, enabled)
    return out


def test_fewer_tokens_than_block_m():  # T < BLOCK_M: one padded block per used expert
    ids = ids_([[1, 0], [1, 3], [0, 1]])
    out = align_and_check(ids, ids_([0, 0, 0]), 4, 16, 1)
    pad = 6
    assert align_capacity(3, 2, 4, 16) == out.sorted_token_ids.shape[1] == 80
    expected_rows = torch.full((1, 80), pad, dtype=I32)
    expected_rows[0, 0:2] = torch.tensor([1, 4])  # expert 0: pairs (t0, k1), (t2, k0)
    expected_rows[0, 16:19] = torch.tensor([0, 2, 5])  # expert 1
    expected_rows[0, 32] = 3  # expert 3
    assert_exact(out.sorted_token_ids, expected_rows, what="sorted_token_ids")
    assert_exact(out.expert_ids, ids_([[0, 1, 3, -1, -1]]), what="expert_ids")
    assert_exact(out.num_tokens_post_padded, ids_([48]), what="num_tokens_post_padded")


def test_all_tokens_to_one_expert():  # one expert spans several blocks, others take none
    ids = torch.full((20, 1), 2, dtype=I32)
    out = align_and_check(ids, torch.zeros(20, dtype=I32), 4, 8, 1)
    assert out.num_tokens_post_padded.tolist() == [24]
    assert out.expert_ids[0, :3].tolist() == [2, 2, 2] and set(out.expert_ids[0, 3:].tolist()) == {-1}
    assert out.sorted_token_ids[0, :20].tolist() == list(range(20))
    assert out.sorted_token_ids[0, 20:].tolist() == [20] * (out.sorted_token_ids.shape[1] - 20)


def test_empty_experts_take_no_block():  # experts 1 and 3 have no pair
    ids = ids_([[0, 2], [2, 0], [4, 2]])
    out = align_and_check(ids, ids_([0, 0, 0]), 5, 2, 1)
    assert out.expert_ids[0].tolist()[:4] == [0, 2, 2, 4]
    assert out.num_tokens_post_padded.tolist() == [8]


def test_expert_ids_minus_one_and_E_are_skipped():  # EP sentinel and an extra fused expert
    ids = ids_([[-1, 1], [4, 0], [1, -1]])  # E = 4: id 4 is a shared expert, no LoRA
    out = align_and_check(ids, ids_([0, 0, 0]), 4, 4, 1)
    rows = out.sorted_token_ids[0].tolist()
    assert sorted(r for r in rows if r != 6) == [1, 3, 4]
    assert out.expert_ids[0].tolist()[:2] == [0, 1]
    assert out.num_tokens_post_padded.tolist() == [8]


def test_single_token():
    out = align_and_check(ids_([[3, 1]]), ids_([1]), 4, 16, 2)
    assert out.num_tokens_post_padded.tolist() == [0, 32]
    assert out.sorted_token_ids[1, 0].item() == 1 and out.sorted_token_ids[1, 16].item() == 0
    assert out.expert_ids[1, :2].tolist() == [1, 3]


def test_top_k_one():
    ids = ids_([[2], [0], [2], [1]])
    out = align_and_check(ids, ids_([0, 1, 0, 1]), 3, 2, 2)
    assert out.sorted_token_ids[0, :2].tolist() == [0, 2] and out.expert_ids[0, 0].item() == 2
    assert out.sorted_token_ids[1, :4].tolist() == [1, 4, 3, 4] and out.expert_ids[1, :2].tolist() == [0, 1]


def test_disabled_slot_stays_empty():  # tokens on slot 1 while adapter_enabled[1] = 0
    ids = ids_([[0, 1], [1, 2], [2, 0]])
    mapping = ids_([1, 0, 1])
    out = align_and_check(ids, mapping, 3, 4, 2, enabled=[1, 0])
    assert out.num_tokens_post_padded.tolist() == [8, 0]
    assert set(out.sorted_token_ids[1].tolist()) == {6}
    assert set(out.expert_ids[1].tolist()) == {-1}


def test_base_tokens_mixed_in():  # NO_ADAPTER tokens appear in no slot
    ids = ids_([[0, 1], [0, 1], [0, 1], [0, 1]])
    out = align_and_check(ids, ids_([-1, 0, -1, 0]), 2, 2, 1)
    assert sorted(r for r in out.sorted_token_ids[0].tolist() if r != 8) == [2, 3, 6, 7]


def test_graph_capacity_tail_rows_are_skipped():  # M = capacity 8; rows 3.. are the reset tail
    ids = torch.zeros(8, 2, dtype=I32)  # stale ids in the tail must not matter
    ids[:3] = ids_([[1, 0], [0, 2], [2, 1]])
    mapping = ids_([0, 1, 0, -1, -1, -1, -1, -1])
    out = align_and_check(ids, mapping, 3, 4, 2)
    assert out.sorted_token_ids.shape == (2, align_capacity(8, 2, 3, 4))
    pad = 16  # M * top_k with M the capacity
    assert max(r for r in out.sorted_token_ids.flatten().tolist() if r != pad) < 6


def test_idle_batch_is_all_padding():
    out = align_and_check(torch.zeros(0, 2, dtype=I32), torch.zeros(0, dtype=I32), 4, 16, 3)
    empty = AlignOutput.empty(3, 0, 2, 4, 16)
    for got, want, name in zip(out, empty, AlignOutput._fields):
        assert_exact(got, want, what=name)


@pytest.mark.parametrize("call, field", [
    (lambda: moe_lora_align_block_size(ids_([[0]]), ids_([2]), 2, 4, 2), r"token_lora_mapping\[0\]"),
    (lambda: moe_lora_align_block_size(ids_([[0]]), ids_([-2]), 2, 4, 2), r"token_lora_mapping\[0\]"),
    (lambda: moe_lora_align_block_size(ids_([[0]]), ids_([0, 0]), 2, 4, 2), "token_lora_mapping"),
    (lambda: moe_lora_align_block_size(torch.zeros(1, 1), ids_([0]), 2, 4, 2), "topk_ids"),
    (lambda: moe_lora_align_block_size(ids_([[0]]), ids_([0]), 2, 0, 2), "block_m"),
    (lambda: moe_lora_align_block_size(ids_([[0]]), ids_([0]), 0, 4, 2), "num_experts"),
    (lambda: moe_lora_align_block_size(ids_([[0]]), ids_([0]), 2, 4, 2, [1]), "adapter_enabled"),
])
def test_malformed_inputs_raise(call, field):
    with pytest.raises(InvalidFieldError, match=field):
        call()


# --- the checker: legal variations pass, every corruption is caught -----------------------------

IDS = ids_([[0, 1], [1, 0], [0, 2], [1, 2], [0, 1], [2, 0]])
MAP = ids_([0, 0, 1, 0, 1, -1])
E, BM, L = 3, 2, 2


def good():
    return moe_lora_align_block_size(IDS, MAP, E, BM, L)


def check(out, **kw):
    check_alignment(out, IDS, MAP, E, BM, L, seed=1234, **kw)


def test_checker_accepts_rows_shuffled_within_an_expert_and_experts_reordered():
    out = good()
    # slot 0: expert 0 = pairs {0, 3} (block 0); expert 1 = {1, 2, 6} (blocks 1-2); expert 2 = {7} (block 3)
    assert out.expert_ids[0, :4].tolist() == [0, 1, 1, 2]
    assert out.sorted_token_ids[0, :8].tolist() == [0, 3, 1, 2, 6, 12, 7, 12]
    out.sorted_token_ids[0, :8] = ids_([12, 7, 12, 6, 2, 1, 3, 0])
    out.expert_ids[0, :4] = ids_([2, 1, 1, 0])
    check(out)


@pytest.mark.parametrize("corrupt, message", [
    (lambda o: o.sorted_token_ids[0].__setitem__(0, 12), "missing pairs"),  # a pair dropped to padding
    (lambda o: o.sorted_token_ids[0].__setitem__(5, 1), "more than once"),  # pair 1 again in expert 1
    (lambda o: o.sorted_token_ids[0].__setitem__(0, 1), "does not belong here"),  # pair of expert 1 in expert 0
    (lambda o: o.sorted_token_ids[0].__setitem__(9, -1), "out-of-range value -1"),  # padding row not M*k
    (lambda o: o.num_tokens_post_padded.__setitem__(1, 8), "num_tokens_post_padded = 8"),
    (lambda o: o.expert_ids[0].__setitem__(6, 1), "past the last used block"),  # stale block id
    (lambda o: o.sorted_token_ids[1].__setitem__(10, 4), "past num_tokens_post_padded"),  # stale tail row
    (lambda o: o.sorted_token_ids[1].__setitem__(0, 2), "belong"),  # slot 0's pair in slot 1
    (lambda o: o.expert_ids[0].__setitem__(3, 1), "expert 1: 3 blocks, expected 2"),  # block of expert 2 relabelled
])
def test_checker_rejects_each_corruption_with_coordinates(corrupt, message):
    out = good()
    corrupt(out)
    with pytest.raises(AssertionError, match=message) as info:
        check(out)
    assert "seed=1234" in str(info.value)


def test_checker_rejects_non_consecutive_expert_blocks():
    out = good()
    out.expert_ids[0, :4] = ids_([1, 0, 1, 2])
    out.sorted_token_ids[0, :8] = ids_([1, 2, 0, 3, 6, 12, 7, 12])
    with pytest.raises(AssertionError, match="must be consecutive"):
        check(out)


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o._replace(sorted_token_ids=o.sorted_token_ids.long()), "dtype torch.int64"),
    (lambda o: o._replace(expert_ids=o.expert_ids[:, :-1]), "expert_ids: shape"),
    (lambda o: o._replace(num_tokens_post_padded=o.num_tokens_post_padded[:1]), "num_tokens_post_padded: shape"),
])
def test_checker_rejects_wrong_dtypes_and_shapes(mutate, message):
    with pytest.raises(AssertionError, match=message):
        check(mutate(good()))


def test_checker_rejects_a_disabled_slot_with_rows():
    out = good()  # computed with every slot enabled
    with pytest.raises(AssertionError, match=r"slot 1 \(disabled\)"):
        check(out, adapter_enabled=[1, 0])


def test_checker_skips_disabled_slots_only_when_told():
    # An align that leaves a disabled slot's rows untouched (SGLang's JIT align) for a consumer that
    # never reads them: the rows of slot 1 hold garbage, the count a stale value.
    ids, mapping = ids_([[0, 1], [1, 2], [2, 0]]), ids_([1, 0, 1])
    out = moe_lora_align_block_size(ids, mapping, 3, 4, 2, [1, 0])
    out.sorted_token_ids[1].fill_(-1084073718)
    out.expert_ids[1].fill_(7)
    out.num_tokens_post_padded[1] = 16843009
    check_alignment(out, ids, mapping, 3, 4, 2, [1, 0], check_disabled_slots=False)
    with pytest.raises(AssertionError, match=r"slot 1 \(disabled\)"):
        check_alignment(out, ids, mapping, 3, 4, 2, [1, 0])
    out.sorted_token_ids[0, 0] = 6  # an enabled slot's pair dropped to padding: still caught
    with pytest.raises(AssertionError, match=r"slot 0 expert .*missing pairs"):
        check_alignment(out, ids, mapping, 3, 4, 2, [1, 0], check_disabled_slots=False)


# --- Hypothesis: the twin against the checker and a sort-based formulation ------------------------

def sort_based_align(ids, mapping, E, bm, L, enabled):
    """An independent formulation: stable sort of pair keys (slot, expert), padded offsets by cumsum."""
    M, k = ids.shape
    pad = M * k
    cap = align_capacity(M, k, E, bm)
    out = AlignOutput.empty(L, M, k, E, bm)
    slot = mapping.long().repeat_interleave(k)
    expert = ids.long().reshape(-1)
    en = torch.as_tensor(enabled if enabled is not None else [1] * L, dtype=torch.long)
    keep = (slot >= 0) & (expert >= 0) & (expert < E)
    keep &= en[slot.clamp(min=0)] > 0
    pairs = torch.arange(M * k)[keep]
    key = slot[keep] * E + expert[keep]
    order = torch.sort(key, stable=True).indices
    pairs, key = pairs[order], key[order]
    counts = torch.bincount(key, minlength=L * E).reshape(L, E)
    padded = (counts + bm - 1) // bm * bm
    starts = torch.cumsum(padded, 1) - padded  # [L, E] first row of each group
    group_start = torch.cumsum(torch.bincount(key, minlength=L * E), 0) - torch.bincount(key, minlength=L * E)
    rank = torch.arange(len(key)) - group_start[key]
    rows = starts.reshape(-1)[key] + rank
    out.sorted_token_ids.view(-1)[(key // E) * cap + rows] = pairs.to(I32)
    for s in range(L):
        for e in range(E):
            b0 = int(starts[s, e]) // bm
            out.expert_ids[s, b0 : b0 + int(padded[s, e]) // bm] = e
    out.num_tokens_post_padded.copy_(padded.sum(1).to(I32))
    assert out.sorted_token_ids.numel() == 0 or out.sorted_token_ids.max() <= pad
    return out


def assert_twin_matches(ids, mapping, E_, bm, L_, enabled, seed):
    out = moe_lora_align_block_size(ids, mapping, E_, bm, L_, enabled)
    check_alignment(out, ids, mapping, E_, bm, L_, enabled, seed=seed)
    other = sort_based_align(ids, mapping, E_, bm, L_, enabled)
    for got, want, name in zip(out, other, AlignOutput._fields):
        assert_exact(got, want, what=name, seed=seed)


def test_zero_capacity_when_idle_with_block_m_1():  # M = 0 and BLOCK_M = 1 give P = 0: empty buffers
    ids = torch.zeros(0, 1, dtype=I32)
    out = moe_lora_align_block_size(ids, torch.zeros(0, dtype=I32), 1, 1, 1, None)
    assert out.sorted_token_ids.shape == (1, 0) and out.expert_ids.shape == (1, 0)
    assert_twin_matches(ids, torch.zeros(0, dtype=I32), 1, 1, 1, None, seed=None)


def test_sort_formulation_agrees_when_every_pair_goes_to_one_slot():  # worst-case padding of one slot
    ids = torch.stack([torch.ones(9, dtype=I32), torch.zeros(9, dtype=I32)], dim=1)
    assert_twin_matches(ids, torch.zeros(9, dtype=I32), 2, 4, 3, None, seed=None)


@given(problem=align_problems(CAPS, block_sizes=(1, 2, 4, 16)))
def test_twin_passes_checker_and_equals_sort_formulation(problem):
    ids, mapping, enabled = problem.materialize()
    assert_twin_matches(ids, mapping, problem.num_experts, problem.block_m, problem.max_loras, enabled,
                        seed=problem.seed)


@given(problem=align_problems(CAPS), data=st.data())
def test_checker_catches_a_dropped_pair(problem, data):
    ids, mapping, enabled = problem.materialize()
    out = moe_lora_align_block_size(ids, mapping, problem.num_experts, problem.block_m, problem.max_loras, enabled)
    pad = ids.numel()
    real = (out.sorted_token_ids != pad).nonzero().tolist()
    if not real:
        return  # nothing routed to any enabled slot: nothing to drop
    s, r = real[data.draw(st.integers(0, len(real) - 1), label="which pair row to drop")]
    out.sorted_token_ids[s, r] = pad
    with pytest.raises(AssertionError, match="missing pairs"):
        check_alignment(out, ids, mapping, problem.num_experts, problem.block_m, problem.max_loras, enabled)
