"""Host-side segmentations of a batch for the dense LoRA kernels (DESIGN.md §3, §5).

A segmentation cuts the token rows of a batch into segments that each use one adapter slot; the
segmented kernels run one program row per segment. Everything here is plain Python on the
``BatchSpec``'s host lists (no tensor, no device): ``prepare`` stages the result.

- :func:`request_segments`: one segment per request, batch order (``triton`` in EXTEND);
- :func:`adapter_segments`: requests stably sorted by slot, one segment per slot, with the token
  permutation (``triton`` in DECODE: one segment per adapter);
- :func:`tile_segments`: runs of adjacent same-slot requests cut into tiles of at most ``tile``
  tokens (``triton`` in the prefill graph);
- :func:`chunk_segments`: tokens stably sorted by slot, each slot's run cut into chunks of at most
  ``chunk_size`` tokens, with the permutation (``csgmv``).

All four are built from the same pieces: :func:`slot_runs` (adjacent requests on one slot joined),
:func:`cut_runs` (runs cut into pieces of a bounded length) and :func:`segmentation_of`.

Base tokens keep segments of slot ``NO_ADAPTER`` (the kernels skip them), so every token lies in
exactly one segment. Segments cover consecutive positions of the permuted order where a
permutation is set (``permutation[i]`` = original row read at sorted position i).

Capacities (graph mode: host numbers fixed at capture, DESIGN.md §3): :func:`max_tile_segments`,
:func:`max_chunk_segments`, :func:`max_adapter_segments` bound the segment count of any batch that
fits a family; :func:`chunk_size_for` picks the chunk size from a token count (a capacity in graph
mode).

The readable twins are in ``moelora_reference.segments``; ``packages/backends/tests`` checks these
against them exactly. Sources: S-LoRA / Punica SGMV (arXiv:2311.03285, arXiv:2310.18547); SGLang's
LoRA backends (``triton_backend.py``; ``chunked_backend.py``, sgl-project/sglang#10286).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter

from moelora_core.batch import BatchSpec
from moelora_core.errors import InvalidFieldError
from moelora_core.metadata import Segmentation

#: Tokens per prefill-graph tile (DESIGN.md §5).
PREFILL_TILE = 16
#: Smallest and largest csgmv chunk (SGLang's chunked backend starts at 16 as well).
MIN_CHUNK = 16
MAX_CHUNK = 128
#: Tokens per chunk ~ tokens / CHUNKS_PER_BATCH, clamped to [MIN_CHUNK, MAX_CHUNK].
CHUNKS_PER_BATCH = 64
#: Largest segment count of one launch (the dense kernels' segment axis).
MAX_SEGMENTS = 65535


def slot_runs(requests: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(slot, tokens) of each run of adjacent requests on the same slot, given (slot, tokens) per
    request in order."""
    return [(slot, sum(n for _, n in run)) for slot, run in groupby(requests, key=itemgetter(0))]


def cut_runs(runs: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """(slot, tokens) of the pieces each run is cut into, in order: pieces of ``size`` tokens, only
    a run's last piece shorter."""
    return [(slot, min(size, n - start)) for slot, n in runs for start in range(0, n, size)]


def segmentation_of(pieces: list[tuple[int, int]], permutation: list[int] | None = None) -> Segmentation:
    """The segmentation with one segment per (slot, tokens) piece, in order."""
    indptr = [0]
    for _, n in pieces:
        indptr.append(indptr[-1] + n)
    return Segmentation(indptr, [slot for slot, _ in pieces], permutation)


def _requests(batch: BatchSpec) -> list[tuple[int, int]]:
    return list(zip(batch.req_weight_indices, batch.seq_lens))


def _sorted_by_slot(batch: BatchSpec) -> tuple[list[tuple[int, int]], list[int]]:
    """(slot, tokens) of the requests stably sorted by slot (``NO_ADAPTER`` first), and the
    permutation of token rows that order gives (each request's rows kept in order)."""
    starts, requests = batch.req_seg_indptr, _requests(batch)
    order = sorted(range(batch.bs), key=batch.req_weight_indices.__getitem__)  # stable
    permutation = [row for r in order for row in range(starts[r], starts[r + 1])]
    return [requests[r] for r in order], permutation


def request_segments(batch: BatchSpec) -> Segmentation:
    """One segment per request in batch order: ``seg_indptr = req_seg_indptr``, slots per request."""
    return Segmentation.per_request(batch)


def adapter_segments(batch: BatchSpec) -> Segmentation:
    """Requests stably sorted by slot (``NO_ADAPTER`` first), one segment per slot of the batch,
    and the permutation of token rows (each request's rows kept in order)."""
    requests, permutation = _sorted_by_slot(batch)
    return segmentation_of(slot_runs(requests), permutation)


def tile_segments(batch: BatchSpec, tile: int = PREFILL_TILE) -> Segmentation:
    """Runs of adjacent requests on the same slot, each cut into tiles of at most ``tile`` tokens,
    batch order (no permutation).

    Merging a run first gives fewer tiles (and fewer programs) when neighbours share an adapter;
    the count stays within :func:`max_tile_segments` because a run's tiles number at most the sum of
    its requests' ``ceil(len / tile)``. Twin: ``moelora_reference.segments.tile_segments(...,
    merge=True)``.
    """
    return segmentation_of(cut_runs(slot_runs(_requests(batch)), tile))


def chunk_segments(batch: BatchSpec, chunk_size: int) -> Segmentation:
    """Tokens stably sorted by slot (``NO_ADAPTER`` first); each slot's run cut into chunks of at
    most ``chunk_size`` tokens (only a slot's last chunk may be shorter), with the permutation.

    Raises:
        InvalidFieldError: ``chunk_size < 1``.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidFieldError("chunk_size", f"must be an int >= 1, got {chunk_size!r}")
    requests, permutation = _sorted_by_slot(batch)
    return segmentation_of(cut_runs(slot_runs(requests), chunk_size), permutation)


def chunk_size_for(num_tokens: int) -> int:
    """The csgmv chunk size for ``num_tokens`` tokens (the token capacity in graph mode): a power of
    two near ``num_tokens / 64``, within [16, 128]. Small batches get short chunks (little padding
    in a chunk's last tile), large ones long chunks (fewer programs, each reusing its slot's A and B
    over more rows)."""
    want = max(1, num_tokens // CHUNKS_PER_BATCH)
    size = MIN_CHUNK
    while size < want and size < MAX_CHUNK:
        size *= 2
    return size


def max_tile_segments(max_num_tokens: int, max_num_requests: int, tile: int = PREFILL_TILE) -> int:
    """Tiles of any batch of at most ``max_num_tokens`` tokens in ``max_num_requests`` requests:
    Σ_r ceil(n_r / tile) <= (N + (tile - 1)·bs) / tile <= N // tile + bs."""
    return max_num_tokens // tile + min(max_num_requests, max_num_tokens)


def max_chunk_segments(num_tokens: int, max_requests: int, max_loras: int, chunk_size: int) -> int:
    """Chunks of any batch within (``num_tokens``, ``max_requests``): one partial chunk at most per
    slot group, and at most ``max_loras + 1`` groups (every slot and ``NO_ADAPTER``)."""
    groups = min(max_loras + 1, max_requests, num_tokens)
    return min(num_tokens, num_tokens // chunk_size + groups)


def max_adapter_segments(max_requests: int, max_loras: int) -> int:
    """Segments of the adapter-sorted segmentation: one per distinct slot (``NO_ADAPTER`` included)."""
    return min(max_requests, max_loras + 1)


def check_segment_capacity(family: str, segments: int, max_len: int = 1) -> int:
    """A graph family's launch shape within CUDA's grid limits: at most :data:`MAX_SEGMENTS` segments,
    and at most as many 16-row tiles of the longest segment (the tile axis of the dense kernels).

    Raises:
        InvalidFieldError: a larger launch (the capacities are too large for one launch).
    """
    if segments > MAX_SEGMENTS:
        raise InvalidFieldError(family, f"its capacities need up to {segments} segments per launch, over the "
                                        f"{MAX_SEGMENTS} a grid axis allows; use smaller capacities")
    tiles = -(-max_len // MIN_CHUNK)
    if tiles > MAX_SEGMENTS:
        raise InvalidFieldError(family, f"its longest segment of {max_len} tokens needs {tiles} tiles per launch, "
                                        f"over the {MAX_SEGMENTS} a grid axis allows; use smaller capacities")
    return segments
