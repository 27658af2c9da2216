"""The token→adapter mapping twin and ``adapter_enabled``.

Covers: graph-capacity tails (-1 past the last live offset, tail segments empty), empty segments,
IDLE, refusals; Hypothesis: the twin equals the BatchSpec's host lists and a repeat_interleave
formulation, in eager and graph (capacity-padded) form, and so does the device mapper of backends
without a mapping kernel (``moelora_core.metadata.map_tokens_torch``), ``adapter_enabled`` included.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import batch_plans, capped
from moelora_core import InvalidFieldError, assert_exact
from moelora_core.metadata import map_tokens_torch
from moelora_reference.mapping import adapter_enabled, token_lora_mapping

# The float64 loop oracle and the loop twins run on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def test_graph_capacity_tail_maps_to_no_adapter():
    # capacity 4 requests / 8 tokens; live: 2 requests of 2 and 1 tokens; tails reset
    out = token_lora_mapping([0, 2, 3, 3, 3], [1, 0, -1, -1], 8)
    assert out.dtype == torch.int32
    assert out.tolist() == [1, 1, 0, -1, -1, -1, -1, -1]


def test_empty_segment_in_the_middle_writes_nothing():
    assert token_lora_mapping([0, 1, 1, 3], [2, 0, 1], 3).tolist() == [2, 1, 1]


def test_idle_batch_has_no_token():
    assert token_lora_mapping([0], [], 0).tolist() == []
    assert adapter_enabled(torch.zeros(0, dtype=torch.int32), 3).tolist() == [0, 0, 0]


def test_adapter_enabled_marks_used_slots_only():
    assert adapter_enabled([2, -1, 2, 0], 4).tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("call, field", [
    (lambda: token_lora_mapping([0, 2], [0, 1], 4), "req_seg_indptr"),  # lengths differ
    (lambda: token_lora_mapping([1, 2], [0], 4), r"req_seg_indptr\[0\]"),
    (lambda: token_lora_mapping([0, 3, 2], [0, 1], 4), r"req_seg_indptr\[2\]"),
    (lambda: token_lora_mapping([0, 5], [0], 4), r"req_seg_indptr\[-1\]"),
    (lambda: token_lora_mapping([0, 1], [-2], 4), r"req_weight_indices\[0\]"),
    (lambda: adapter_enabled([0, 3], 3), r"token_lora_mapping\[1\]"),
])
def test_malformed_inputs_raise(call, field):
    with pytest.raises(InvalidFieldError, match=field):
        call()


@given(plan=batch_plans(4, caps=CAPS), data=st.data())
def test_twin_equals_host_lists_and_repeat_interleave(plan, data):
    batch = plan.batch
    tail = data.draw(st.integers(0, 8), label="graph token tail")
    req_tail = data.draw(st.integers(0, 3), label="graph request tail")
    T = batch.num_tokens
    indptr = [*batch.req_seg_indptr, *([T] * req_tail)]
    slots = [*batch.req_weight_indices, *([-1] * req_tail)]
    indptr_t, slots_t = torch.tensor(indptr, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
    got = token_lora_mapping(indptr_t, slots_t, T + tail)
    host = torch.tensor([*batch.token_lora_mapping, *([-1] * tail)], dtype=torch.int32)
    assert_exact(got, host, what="token_lora_mapping vs BatchSpec")
    lens = torch.tensor(batch.seq_lens, dtype=torch.long)
    other = torch.full((T + tail,), -1, dtype=torch.int32)
    other[:T] = torch.repeat_interleave(torch.tensor(batch.req_weight_indices, dtype=torch.int32), lens)
    assert_exact(got, other, what="token_lora_mapping vs repeat_interleave")
    enabled = torch.tensor(batch.adapter_enabled, dtype=torch.int32)
    assert_exact(adapter_enabled(got, 4), enabled, what="adapter_enabled")
    mapping_out, enabled_out = torch.full((T + tail,), 7, dtype=torch.int32), torch.full((4,), 7, dtype=torch.int32)
    map_tokens_torch(indptr_t, slots_t, 4, mapping_out, enabled_out)  # poisoned outputs: every element written
    assert_exact(mapping_out, got, what="map_tokens_torch vs the twin")
    assert_exact(enabled_out, enabled, what="map_tokens_torch adapter_enabled")
