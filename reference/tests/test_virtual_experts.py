"""Virtual expert ids: (slot, expert) → slot·E + expert with sentinels kept as -1.

Covers: id E and -1 never land on another adapter's expert, NO_ADAPTER tokens, dtype kept, the
inverse; Hypothesis: the twin equals a torch.where formulation and round-trips through the inverse.
"""

import pytest
import torch
from hypothesis import given

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import align_problems, capped
from moelora_core import InvalidFieldError, assert_exact
from moelora_reference.virtual_experts import split_virtual_ids, virtual_topk_ids

# The float64 loop oracle and the loop twins run on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def test_sentinels_never_land_on_another_adapters_expert():
    E = 4
    ids = torch.tensor([[4, -1], [3, 5], [0, 2]], dtype=torch.int32)  # 4 would be slot 1's expert 0
    mapping = torch.tensor([0, 1, -1], dtype=torch.int32)
    out = virtual_topk_ids(ids, mapping, E)
    assert out.tolist() == [[-1, -1], [7, -1], [-1, -1]]
    assert out.dtype == torch.int32


def test_dtype_kept_and_inverse():
    ids = torch.tensor([[1, 2]], dtype=torch.int64)
    out = virtual_topk_ids(ids, torch.tensor([2]), 3)
    assert out.dtype == torch.int64 and out.tolist() == [[7, 8]]
    slot, expert = split_virtual_ids(out, 3)
    assert slot.tolist() == [[2, 2]] and expert.tolist() == [[1, 2]]
    slot, expert = split_virtual_ids(torch.tensor([-1, 0]), 3)
    assert slot.tolist() == [-1, 0] and expert.tolist() == [-1, 0]


@pytest.mark.parametrize("call, field", [
    (lambda: virtual_topk_ids(torch.zeros(2, 1), torch.zeros(2, dtype=torch.int32), 2), "topk_ids"),
    (lambda: virtual_topk_ids(torch.zeros(2, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 2),
     "token_lora_mapping"),
    (lambda: virtual_topk_ids(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([-3]), 2), r"token_lora_mapping\[0\]"),
    (lambda: virtual_topk_ids(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]), 0), "num_experts"),
])
def test_malformed_inputs_raise(call, field):
    with pytest.raises(InvalidFieldError, match=field):
        call()


@given(problem=align_problems(CAPS))
def test_twin_equals_where_formulation_and_round_trips(problem):
    ids, mapping, _ = problem.materialize()
    E, L = problem.num_experts, problem.max_loras
    got = virtual_topk_ids(ids, mapping, E)
    slot = mapping[:, None].expand_as(ids)
    valid = (slot >= 0) & (ids >= 0) & (ids < E)
    want = torch.where(valid, slot * E + ids, torch.full_like(ids, -1))
    assert_exact(got, want, what="virtual_topk_ids", seed=problem.seed)
    assert max(got.flatten().tolist(), default=-1) < L * E
    back_slot, back_expert = split_virtual_ids(got, E)
    assert_exact(back_slot, torch.where(valid, slot, -1), what="slot", seed=problem.seed)
    assert_exact(back_expert, torch.where(valid, ids, -1), what="expert", seed=problem.seed)
