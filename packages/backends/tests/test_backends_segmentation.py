"""The host-side segmentations of ``moelora_backends`` against the readable twins of
``moelora_reference.segments``, exactly, and their capacity bounds.

Covers: named cases (stable ties with base first, speculative decode rows kept together, merged
tiles, 17 tokens → 16 + 1, a slot's chunks never mixing slots, the chunk size ladder); Hypothesis on
drawn batches: per-request, adapter-sorted, merged-tile and chunked segmentations equal their twins
field by field (offsets, slots, permutation), csgmv chunks map back to the batch's per-request slots,
and every segmentation of a batch within a family's capacities stays within the segment and
``max_len`` capacities the family's launches are sized for.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moelora_backends.segmentation import (
    MAX_CHUNK,
    MIN_CHUNK,
    PREFILL_TILE,
    adapter_segments,
    check_segment_capacity,
    chunk_segments,
    chunk_size_for,
    max_adapter_segments,
    max_chunk_segments,
    max_tile_segments,
    request_segments,
    tile_segments,
)
from moelora_conformance.strategies import batch_specs
from moelora_core import BatchSpec, ForwardMode, InvalidFieldError, Request
from moelora_reference import segments as twin


def _batch(mode, lens_slots, max_loras=4):
    requests = [Request(s, n) for n, s in lens_slots]
    return BatchSpec(mode, requests, max_loras, (4,) * max_loras, (1.0,) * max_loras)


def _same(mine, theirs, what):
    assert tuple(mine.seg_indptr) == theirs.seg_indptr, what
    assert tuple(mine.weight_indices) == theirs.weight_indices, what
    perm = None if mine.permutation is None else tuple(mine.permutation)
    assert perm == theirs.permutation, what
    assert tuple(mine.seg_lens) == theirs.seg_lens and mine.max_len == theirs.max_len, what


def test_adapter_segments_sort_stably_with_base_first():  # ties keep batch order
    seg = adapter_segments(_batch(ForwardMode.DECODE, [(1, 2), (1, 0), (1, -1), (1, 2), (1, 0)]))
    assert seg.weight_indices == [-1, 0, 2] and seg.seg_indptr == [0, 1, 3, 5]
    assert seg.permutation == [2, 1, 4, 0, 3]


def test_adapter_segments_keep_speculative_rows_together():  # 2 tokens per request
    seg = adapter_segments(_batch(ForwardMode.DECODE, [(2, 1), (2, 0), (2, 1)]))
    assert seg.permutation == [2, 3, 0, 1, 4, 5] and seg.seg_indptr == [0, 2, 6]


def test_tiles_merge_adjacent_same_slot_requests_and_cut_at_16():  # 17 tokens -> 16 + 1
    seg = tile_segments(_batch(ForwardMode.EXTEND, [(10, 1), (7, 1), (3, -1), (2, 1)]))
    assert seg.seg_indptr == [0, 16, 17, 20, 22] and seg.weight_indices == [1, 1, -1, 1]
    assert seg.permutation is None


def test_chunks_never_mix_slots():
    seg = chunk_segments(_batch(ForwardMode.EXTEND, [(1, 1), (1, 0), (1, 1), (1, -1), (2, 1), (1, 0)]), 2)
    assert seg.permutation == [3, 1, 6, 0, 2, 4, 5]
    assert seg.weight_indices == [-1, 0, 1, 1] and seg.seg_indptr == [0, 1, 3, 5, 7]


@pytest.mark.parametrize(("tokens", "size"), [(1, MIN_CHUNK), (1024, 16), (2048, 32), (4096, 64), (8192, 128),
                                              (1 << 20, MAX_CHUNK)])
def test_chunk_size_grows_with_the_token_count(tokens, size):
    assert chunk_size_for(tokens) == size


def test_a_family_over_the_launch_limit_is_refused():
    assert check_segment_capacity("prefill", 65535) == 65535
    with pytest.raises(InvalidFieldError, match="65536 segments"):
        check_segment_capacity("prefill", 65536)
    assert check_segment_capacity("decode", 9, 16 * 65535) == 9
    with pytest.raises(InvalidFieldError, match="65536 tiles"):  # a decode family whose one adapter holds 2^20 tokens
        check_segment_capacity("decode", 9, 16 * 65536)


def test_chunk_size_must_be_positive():
    with pytest.raises(InvalidFieldError, match="chunk_size"):
        chunk_segments(_batch(ForwardMode.EXTEND, [(1, 0)]), 0)


@st.composite
def _batches(draw):
    max_loras = draw(st.integers(1, 4), label="max_loras")
    kinds = draw(st.sampled_from((("extend", "mixed"), ("decode",), ("extend", "decode", "mixed", "idle"))),
                 label="kinds")
    return draw(batch_specs(max_loras, kinds=kinds), label="batch")


@given(batch=_batches(), chunk=st.sampled_from((1, 2, 3, 16, 32)))
def test_segmentations_equal_their_twins(batch, chunk):
    lens, slots = list(batch.seq_lens), list(batch.req_weight_indices)
    _same(request_segments(batch), twin.request_segments(lens, slots), "per request")
    _same(adapter_segments(batch), twin.decode_adapter_segments(lens, slots), "by adapter")
    _same(tile_segments(batch), twin.tile_segments(lens, slots, PREFILL_TILE, merge=True), "merged tiles")
    mine = chunk_segments(batch, chunk)
    theirs = twin.csgmv_segments(list(batch.token_lora_mapping), chunk)
    _same(mine, theirs, "csgmv chunks")
    req_weight_indices, mapping = twin.chunk_segments_to_requests(theirs, batch.req_seg_indptr)
    assert req_weight_indices == batch.req_weight_indices and mapping == batch.token_lora_mapping


@given(batch=_batches(), slack_requests=st.integers(0, 3), slack_tokens=st.integers(0, 16))
def test_segmentations_stay_within_their_family_capacities(batch, slack_requests, slack_tokens):
    L = batch.max_loras
    max_requests, max_tokens = batch.bs + slack_requests, batch.num_tokens + slack_tokens
    if max_requests < 1 or max_tokens < 1:
        return
    tiles = tile_segments(batch)
    assert tiles.num_segments <= max_tile_segments(max_tokens, max_requests) and tiles.max_len <= PREFILL_TILE
    size = chunk_size_for(max_tokens)
    chunks = chunk_segments(batch, size)
    assert chunks.num_segments <= max_chunk_segments(max_tokens, max_requests, L, size)
    assert chunks.max_len <= min(size, max_tokens)
    if batch.forward_mode is ForwardMode.DECODE:
        adapters = adapter_segments(batch)
        assert adapters.num_segments <= max_adapter_segments(max_requests, L)
        assert adapters.max_len <= max_tokens
