"""The token → adapter mapping kernel against the twin, eagerly and on graph-capacity buffers.

Covers: drawn batches (more than 32 requests, base and adapter requests mixed, rank-0 slots) with
request and token capacity tails (seg_indptr tail = last live offset, req_weight_indices tail -1) written
into buffers poisoned with stale values; a smaller batch after a larger one on the same buffers;
an IDLE batch on static buffers; launcher precondition errors.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, launch_guard

from moelora_conformance.profiles import current_profile
from moelora_conformance.strategies import batch_plans
from moelora_core import NO_ADAPTER, KernelPreconditionError, assert_exact
from moelora_kernels import token_lora_mapping
from moelora_reference import mapping as twin

pytestmark = pytest.mark.interpreter


def _static(batch, req_capacity, token_capacity):
    """Host lists padded to capacity as a graph family's static buffers hold them."""
    indptr = list(batch.req_seg_indptr) + [batch.num_tokens] * (req_capacity - batch.bs)
    slots = list(batch.req_weight_indices) + [NO_ADAPTER] * (req_capacity - batch.bs)
    return (torch.tensor(indptr, dtype=torch.int32, device=DEVICE),
            torch.tensor(slots, dtype=torch.int32, device=DEVICE), token_capacity)


def _run_and_check(seg_indptr, req_weight_indices, num_tokens, max_loras, mapping_out=None, enabled_out=None, seed=None):
    if mapping_out is None:
        mapping_out = torch.full((num_tokens,), 0x7FFF, dtype=torch.int32, device=DEVICE)
    if enabled_out is None:
        enabled_out = torch.full((max_loras,), 7, dtype=torch.int32, device=DEVICE)
    with launch_guard():
        token_lora_mapping(seg_indptr, req_weight_indices, max_loras=max_loras, mapping_out=mapping_out,
                           adapter_enabled_out=enabled_out)
    want = twin.token_lora_mapping(seg_indptr.cpu(), req_weight_indices.cpu(), num_tokens)
    assert_exact(mapping_out, want, what="token_lora_mapping", seed=seed)
    assert_exact(enabled_out, twin.adapter_enabled(want, max_loras), what="adapter_enabled", seed=seed)
    return mapping_out, enabled_out


@st.composite
def _batches_with_capacity(draw):
    caps = current_profile().caps
    L = draw(st.integers(1, caps.max_loras), label="max_loras")
    plan = draw(batch_plans(L, caps=caps), label="batch")
    req_cap = plan.batch.bs + draw(st.integers(0, 40), label="request tail")
    tok_cap = plan.batch.num_tokens + draw(st.integers(0, 40), label="token tail")
    return plan, req_cap, tok_cap


@given(drawn=_batches_with_capacity())
def test_mapping_matches_twin_with_capacity_tails(drawn):
    plan, req_cap, tok_cap = drawn
    seg_indptr, req_weight_indices, num_tokens = _static(plan.batch, req_cap, tok_cap)
    mapping, enabled = _run_and_check(seg_indptr, req_weight_indices, num_tokens, plan.batch.max_loras)
    # and the batch's own host lists agree with the device result
    live = list(plan.batch.token_lora_mapping)
    assert mapping[: len(live)].tolist() == live
    assert enabled.tolist() == list(plan.batch.adapter_enabled)


def test_smaller_batch_after_a_larger_one_resets_the_tail():
    mapping_out = torch.empty(64, dtype=torch.int32, device=DEVICE)
    enabled_out = torch.empty(3, dtype=torch.int32, device=DEVICE)
    big = (torch.tensor([0, 20, 50, 64], dtype=torch.int32, device=DEVICE),
           torch.tensor([0, 2, 1], dtype=torch.int32, device=DEVICE))
    _run_and_check(*big, 64, 3, mapping_out, enabled_out)
    small = (torch.tensor([0, 5, 5, 5], dtype=torch.int32, device=DEVICE),
             torch.tensor([2, -1, -1], dtype=torch.int32, device=DEVICE))
    mapping, enabled = _run_and_check(*small, 64, 3, mapping_out, enabled_out)
    assert mapping.tolist() == [2] * 5 + [-1] * 59 and enabled.tolist() == [0, 0, 1]


def test_idle_batch_on_static_buffers_maps_nothing():
    # IDLE replayed on a decode graph's buffers: every request empty, every token -1
    seg_indptr = torch.zeros(9, dtype=torch.int32, device=DEVICE)
    req_weight_indices = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
    mapping, enabled = _run_and_check(seg_indptr, req_weight_indices, 8, 2)
    assert mapping.tolist() == [-1] * 8 and enabled.tolist() == [0, 0]


def test_single_request_single_token():
    mapping, enabled = _run_and_check(torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                                      torch.tensor([1], dtype=torch.int32, device=DEVICE), 1, 2)
    assert mapping.tolist() == [1] and enabled.tolist() == [0, 1]


@pytest.mark.parametrize("kwargs, match", [
    ({"seg_indptr": torch.zeros(3, dtype=torch.int64)}, "seg_indptr: dtype"),
    ({"req_weight_indices": torch.zeros(3, dtype=torch.int32)}, "req_weight_indices: expected shape"),
    ({"num_tokens": None}, "num_tokens"),
    ({"mapping_out": torch.zeros(4, dtype=torch.int64)}, "mapping_out: dtype"),
    ({"adapter_enabled_out": torch.zeros(5, dtype=torch.int32)}, "adapter_enabled_out: expected shape"),
    ({"max_loras": 0}, "max_loras"),
])
def test_launcher_refuses_bad_arguments(kwargs, match):
    args = {"seg_indptr": torch.tensor([0, 2, 4], dtype=torch.int32), "req_weight_indices": torch.tensor([0, 1], dtype=torch.int32),
            "max_loras": 2, "num_tokens": 4}
    args.update(kwargs)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    seg_indptr, req_weight_indices = args.pop("seg_indptr"), args.pop("req_weight_indices")
    with pytest.raises(KernelPreconditionError, match=match):
        token_lora_mapping(seg_indptr, req_weight_indices, **args)
