"""Segmentations: per request, decode by adapter, csgmv chunks, prefill tiles, and the way back to
per-request fields.

Covers: named cases (stable order of ties, base segments kept, a chunk never mixing slots, 17 tokens
→ 16 + 1, merged tiles, the tile bound, a request split across slots refused); Hypothesis on drawn
batches: every segmentation gives back the batch's token mapping, permutations are permutations,
each segmentation's own invariants hold, and csgmv chunks map back to the batch's per-request slots.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import batch_plans, capped
from moelora_core import InvalidFieldError
from moelora_reference.segments import (
    PREFILL_TILE,
    Segments,
    chunk_segments_to_requests,
    csgmv_segments,
    decode_adapter_segments,
    max_tile_segments,
    request_segments,
    tile_segments,
)

# The float64 loop oracle and the loop twins run on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def test_request_segments_one_per_request():
    seg = request_segments([3, 1, 2], [1, -1, 1])
    assert seg == Segments((0, 3, 4, 6), (1, -1, 1), None, (0, 1, 2))
    t = seg.tensors()
    assert t["seg_indptr"].dtype == torch.int32 and t["seg_lens"].tolist() == [3, 1, 2]
    assert "permutation" not in t and seg.max_len == 3


def test_decode_segments_sort_requests_stably_by_slot():  # ties keep batch order; base first
    seg = decode_adapter_segments([1, 1, 1, 1, 1], [2, 0, -1, 2, 0])
    assert seg.weight_indices == (-1, 0, 2)
    assert seg.seg_indptr == (0, 1, 3, 5)
    assert seg.permutation == (2, 1, 4, 0, 3)
    assert seg.tensors()["permutation"].dtype == torch.int64


def test_decode_segments_with_speculative_tokens_keep_request_rows_together():
    seg = decode_adapter_segments([2, 2, 2], [1, 0, 1])
    assert seg.permutation == (2, 3, 0, 1, 4, 5) and seg.seg_indptr == (0, 2, 6)


def test_csgmv_chunks_never_mix_slots_and_respect_the_chunk_size():
    seg = csgmv_segments([1, 0, 1, -1, 1, 1, 0], 2)
    assert seg.permutation == (3, 1, 6, 0, 2, 4, 5)
    assert seg.weight_indices == (-1, 0, 1, 1)
    assert seg.seg_indptr == (0, 1, 3, 5, 7)


def test_tiles_cut_each_request_and_never_cross_it():
    seg = tile_segments([17, 3, 32], [0, 0, 1])
    assert seg.seg_lens == (16, 1, 3, 16, 16)
    assert seg.segment_request == (0, 0, 1, 2, 2)
    assert seg.weight_indices == (0, 0, 0, 1, 1)


def test_merged_tiles_join_adjacent_requests_of_one_slot():
    seg = tile_segments([17, 3, 32], [0, 0, 1], merge=True)
    assert seg.seg_lens == (16, 4, 16, 16) and seg.segment_request is None


def test_tile_bound():
    assert max_tile_segments(96, 8) == 96 // PREFILL_TILE + 8
    lens = [1] * 8 + [88]  # worst case: many short requests
    assert tile_segments(lens, [0] * 9).num_segments <= max_tile_segments(96, 9)


def test_chunks_back_to_requests_refuses_a_request_split_across_slots():
    seg = Segments((0, 1, 2), (0, 1), (0, 1), None)
    with pytest.raises(InvalidFieldError, match="request 0"):
        chunk_segments_to_requests(seg, [0, 2])


@pytest.mark.parametrize("call, field", [
    (lambda: csgmv_segments([0], 0), "chunk_size"),
    (lambda: csgmv_segments([-2], 4), r"token_lora_mapping\[0\]"),
    (lambda: tile_segments([1], [0], 0), "tile"),
    (lambda: request_segments([1, 2], [0]), "req_weight_indices"),
    (lambda: request_segments([-1], [0]), r"seq_lens\[0\]"),
    (lambda: chunk_segments_to_requests(request_segments([2], [0]), [0, 3]), "req_seg_indptr"),
])
def test_malformed_inputs_raise(call, field):
    with pytest.raises(InvalidFieldError, match=field):
        call()


def assert_covers(seg, batch, what):
    """Every token in exactly one segment, and the segments give back the batch's token mapping."""
    n = batch.num_tokens
    assert seg.seg_indptr[0] == 0 and seg.num_tokens == n, what
    assert all(a <= b for a, b in zip(seg.seg_indptr, seg.seg_indptr[1:])), what
    if seg.permutation is not None:
        assert sorted(seg.permutation) == list(range(n)), f"{what}: permutation is not a permutation"
    assert seg.token_lora_mapping() == batch.token_lora_mapping, what


@given(plan=batch_plans(4, caps=CAPS), chunk=st.sampled_from([1, 2, 16, 64]))
def test_every_segmentation_describes_the_batch(plan, chunk):
    batch = plan.batch
    lens, slots = batch.seq_lens, batch.req_weight_indices

    per_request = request_segments(lens, slots)
    assert_covers(per_request, batch, "request_segments")
    assert per_request.seg_indptr == batch.req_seg_indptr

    decode = decode_adapter_segments(lens, slots)
    assert_covers(decode, batch, "decode_adapter_segments")
    assert list(decode.weight_indices) == sorted(set(slots))  # one segment per adapter

    csgmv = csgmv_segments(batch.token_lora_mapping, chunk)
    assert_covers(csgmv, batch, "csgmv_segments")
    stable = torch.sort(torch.tensor(batch.token_lora_mapping, dtype=torch.long), stable=True).indices
    assert list(csgmv.permutation) == stable.tolist()
    assert all(1 <= n <= chunk for n in csgmv.seg_lens)
    per_slot = {s: sum(1 for t in batch.token_lora_mapping if t == s) for s in set(batch.token_lora_mapping)}
    assert {s: csgmv.weight_indices.count(s) for s in per_slot} == {s: math.ceil(c / chunk) for s, c in per_slot.items()}
    assert chunk_segments_to_requests(csgmv, batch.req_seg_indptr) == (batch.req_weight_indices, batch.token_lora_mapping)

    tiles = tile_segments(lens, slots)
    assert_covers(tiles, batch, "tile_segments")
    assert tiles.num_segments == sum(math.ceil(n / PREFILL_TILE) for n in lens)
    assert tiles.num_segments <= max_tile_segments(batch.num_tokens, batch.bs)
    for seg_id, r in enumerate(tiles.segment_request):
        lo, hi = tiles.seg_indptr[seg_id], tiles.seg_indptr[seg_id + 1]
        assert batch.req_seg_indptr[r] <= lo < hi <= batch.req_seg_indptr[r + 1], "tile crosses a request"
        assert hi - lo <= PREFILL_TILE
    merged = tile_segments(lens, slots, merge=True)
    assert_covers(merged, batch, "tile_segments(merge=True)")
    assert merged.num_segments <= tiles.num_segments and merged.max_len <= PREFILL_TILE
