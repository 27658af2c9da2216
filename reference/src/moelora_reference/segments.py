"""Readable twins of the dense-LoRA segmentations of a batch (DESIGN.md §3, §5).

A segmentation cuts the batch's token rows into segments that each use one adapter slot, so a
segmented GEMM (SGMV) runs one program per segment. All of them describe the same per-token slot
(a test checks this); they differ in how many segments a launch needs:

- :func:`request_segments`: one segment per request (the ``triton`` backend in EXTEND).
- :func:`decode_adapter_segments`: requests stably sorted by slot, one segment per run of equal
  slots, with a token permutation (the ``triton`` backend in DECODE: one segment per adapter).
- :func:`csgmv_segments`: tokens stably sorted by slot, each slot's run cut into chunks of at most
  ``chunk_size`` tokens, never mixing slots, with the permutation (chunked SGMV, ``csgmv``).
- :func:`tile_segments`: each request cut into ``ceil(len / tile)`` tiles of at most ``tile``
  tokens (the prefill graph: the grid is fixed at capture to ``max_num_tokens // tile +
  max_num_requests``, which bounds the tile count of any batch within capacity).

Every segment covers consecutive rows of the *permuted* token order when ``permutation`` is set
(``permutation[i]`` = original row read at sorted position i), else of the batch order. Segments
of base tokens are kept with weight index ``NO_ADAPTER`` (-1): kernels skip them, and every token
belongs to exactly one segment, which makes coverage checkable.

:func:`chunk_segments_to_requests` maps csgmv chunks back to per-request fields: the MoE path always
reads per request, whatever the dense segmentation (the bug fixed by sgl-project/sglang#24007: MoE
kernels fed csgmv chunks as if they were requests).

Sources: S-LoRA / Punica SGMV (arXiv:2311.03285, arXiv:2310.18547); SGLang's LoRA backends
(``triton_backend.py``; ``chunked_backend.py``, chunked SGMV, sgl-project/sglang#10286); tail
reset of graph segments as in sgl-project/sglang#28371.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.sentinels import NO_ADAPTER
from moelora_reference.mapping import _as_int_list

#: Tile size of prefill-graph segments (DESIGN.md §5).
PREFILL_TILE = 16


@dataclass(frozen=True)
class Segments:
    """A segmentation as host tuples (what a backend stages to the device).

    Attributes:
        seg_indptr: [S + 1] token offsets of the segments, in permuted order if ``permutation``.
        weight_indices: [S] slot of each segment, ``NO_ADAPTER`` = base tokens.
        permutation: [N] original token row at each sorted position, or None (batch order).
        segment_request: [S] the request each segment lies in, or None where a segment may span
            several requests (decode-by-adapter, csgmv chunks, merged tiles).
    """

    seg_indptr: tuple[int, ...]
    weight_indices: tuple[int, ...]
    permutation: tuple[int, ...] | None = None
    segment_request: tuple[int, ...] | None = None

    @property
    def num_segments(self) -> int:
        return len(self.weight_indices)

    @property
    def num_tokens(self) -> int:
        return self.seg_indptr[-1]

    @property
    def seg_lens(self) -> tuple[int, ...]:
        """[S] tokens per segment."""
        return tuple(b - a for a, b in zip(self.seg_indptr[:-1], self.seg_indptr[1:]))

    @property
    def max_len(self) -> int:
        """Longest segment (0 for no segment)."""
        return max(self.seg_lens, default=0)

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The fields as tensors: int32 offsets, lengths, slots and requests; int64 permutation."""
        out = {
            "seg_indptr": torch.tensor(self.seg_indptr, dtype=torch.int32, device=device),
            "seg_lens": torch.tensor(self.seg_lens, dtype=torch.int32, device=device),
            "weight_indices": torch.tensor(self.weight_indices, dtype=torch.int32, device=device),
        }
        if self.permutation is not None:
            out["permutation"] = torch.tensor(self.permutation, dtype=torch.int64, device=device)
        if self.segment_request is not None:
            out["segment_request"] = torch.tensor(self.segment_request, dtype=torch.int32, device=device)
        return out

    def token_lora_mapping(self) -> tuple[int, ...]:
        """[N] slot of every token in the *original* order (undoing the permutation)."""
        n = self.num_tokens
        perm = self.permutation if self.permutation is not None else tuple(range(n))
        out = [NO_ADAPTER] * n
        for seg, slot in enumerate(self.weight_indices):
            for i in range(self.seg_indptr[seg], self.seg_indptr[seg + 1]):
                out[perm[i]] = slot
        return tuple(out)


def _requests(seq_lens, req_weight_indices) -> tuple[list[int], list[int]]:
    lens = _as_int_list("seq_lens", seq_lens)
    slots = _as_int_list("req_weight_indices", req_weight_indices)
    if len(lens) != len(slots):
        raise InvalidFieldError("req_weight_indices", f"has {len(slots)} entries for {len(lens)} requests")
    for r, (n, s) in enumerate(zip(lens, slots)):
        if n < 0:
            raise InvalidFieldError(f"seq_lens[{r}]", f"must be >= 0, got {n}")
        if s < NO_ADAPTER:
            raise InvalidFieldError(f"req_weight_indices[{r}]", f"slot {s} is below NO_ADAPTER (-1)")
    return lens, slots


def _offsets(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def request_segments(seq_lens: Sequence[int] | torch.Tensor,
                     req_weight_indices: Sequence[int] | torch.Tensor) -> Segments:
    """One segment per request, in batch order.

    Args:
        seq_lens: [bs] tokens per request (>= 0).
        req_weight_indices: [bs] slot per request (``NO_ADAPTER`` = base).

    Returns:
        ``Segments`` with S = bs, ``weight_indices = req_weight_indices``, no permutation,
        ``segment_request = 0..bs-1``.

    Raises:
        InvalidFieldError: lengths of different sizes, a negative length, a slot below -1.
    """
    lens, slots = _requests(seq_lens, req_weight_indices)
    return Segments(tuple(_offsets(lens)), tuple(slots), None, tuple(range(len(lens))))


def decode_adapter_segments(
    seq_lens: Sequence[int] | torch.Tensor, req_weight_indices: Sequence[int] | torch.Tensor
) -> Segments:
    """Requests stably sorted by slot; one segment per run of equal slots; a token permutation.

    In DECODE every request has the same length (``tokens_per_request``), but any lengths work.

    Args:
        seq_lens: [bs] tokens per request.
        req_weight_indices: [bs] slot per request.

    Returns:
        ``Segments`` with one segment per distinct slot of the batch (ascending, ``NO_ADAPTER``
        first), ``permutation`` [N] = the token rows of the requests in sorted order (each
        request's rows kept in order), ``segment_request`` None.
    """
    lens, slots = _requests(seq_lens, req_weight_indices)
    starts = _offsets(lens)
    order = sorted(range(len(lens)), key=lambda r: slots[r])  # Python's sort is stable
    permutation: list[int] = []
    indptr, weights = [0], []
    for r in order:
        if weights and weights[-1] == slots[r]:
            indptr[-1] += lens[r]
        else:
            weights.append(slots[r])
            indptr.append(indptr[-1] + lens[r])
        permutation.extend(range(starts[r], starts[r] + lens[r]))
    return Segments(tuple(indptr), tuple(weights), tuple(permutation), None)


def csgmv_segments(token_lora_mapping: Sequence[int] | torch.Tensor, chunk_size: int) -> Segments:
    """Tokens stably sorted by slot, each slot's run cut into chunks of at most ``chunk_size``.

    Args:
        token_lora_mapping: [N] slot per token (``NO_ADAPTER`` = base).
        chunk_size: tokens per chunk (>= 1).

    Returns:
        ``Segments`` whose segments never mix slots and hold at most ``chunk_size`` tokens (only a
        slot's last chunk may be shorter), ``permutation`` [N] = stable sort of the tokens by slot,
        ``segment_request`` None.

    Raises:
        InvalidFieldError: ``chunk_size < 1`` or a slot below -1.
    """
    mapping = _as_int_list("token_lora_mapping", token_lora_mapping)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidFieldError("chunk_size", f"must be an int >= 1, got {chunk_size!r}")
    for t, s in enumerate(mapping):
        if s < NO_ADAPTER:
            raise InvalidFieldError(f"token_lora_mapping[{t}]", f"slot {s} is below NO_ADAPTER (-1)")
    permutation = sorted(range(len(mapping)), key=lambda t: mapping[t])
    indptr, weights = [0], []
    run_slot, run_len = None, 0
    for t in permutation:
        slot = mapping[t]
        if slot == run_slot and run_len < chunk_size:
            indptr[-1] += 1
            run_len += 1
        else:  # a new slot, or the current chunk is full
            weights.append(slot)
            indptr.append(indptr[-1] + 1)
            run_slot, run_len = slot, 1
    return Segments(tuple(indptr), tuple(weights), tuple(permutation), None)


def tile_segments(
    seq_lens: Sequence[int] | torch.Tensor,
    req_weight_indices: Sequence[int] | torch.Tensor,
    tile: int = PREFILL_TILE,
    *,
    merge: bool = False,
) -> Segments:
    """Cut each request into ``ceil(len / tile)`` tiles of at most ``tile`` tokens (prefill graph).

    Decision (DESIGN.md §5 leaves it open): a tile never crosses a request boundary, so a
    request's tokens are a whole number of tiles, ``segment_request`` names each tile's request,
    and the tile count is bounded by ``max_tile_segments(N, bs, tile)``. With ``merge=True``,
    adjacent requests on the same slot are merged first (fewer tiles, same bound; tiles may then
    span requests, and ``segment_request`` is None).

    Args:
        seq_lens: [bs] tokens per request.
        req_weight_indices: [bs] slot per request.
        tile: tokens per tile (>= 1).
        merge: merge adjacent same-slot requests before cutting.

    Returns:
        ``Segments`` in batch order (no permutation).

    Raises:
        InvalidFieldError: ``tile < 1``, or as :func:`request_segments`.
    """
    lens, slots = _requests(seq_lens, req_weight_indices)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise InvalidFieldError("tile", f"must be an int >= 1, got {tile!r}")
    runs: list[tuple[int, int, int]] = []  # (length, slot, first request)
    for r, (n, s) in enumerate(zip(lens, slots)):
        if merge and runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0] + n, s, runs[-1][2])
        else:
            runs.append((n, s, r))
    indptr, weights, owners = [0], [], []
    for n, s, r in runs:
        for start in range(0, n, tile):
            indptr.append(indptr[-1] + min(tile, n - start))
            weights.append(s)
            owners.append(r)
    return Segments(tuple(indptr), tuple(weights), None, None if merge else tuple(owners))


def max_tile_segments(max_num_tokens: int, max_num_requests: int, tile: int = PREFILL_TILE) -> int:
    """Grid bound of the prefill graph: ``max_num_tokens // tile + max_num_requests``.

    Σ_r ceil(n_r / tile) <= floor((N + (tile - 1)·bs) / tile) <= N // tile + bs for Σ n_r = N.
    """
    return max_num_tokens // tile + max_num_requests


def chunk_segments_to_requests(
    segments: Segments, req_seg_indptr: Sequence[int] | torch.Tensor
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-request fields from a csgmv (or any) segmentation, so the MoE path reads per request.

    Args:
        segments: a segmentation covering the batch's N tokens.
        req_seg_indptr: [bs + 1] token offsets of the requests (batch order), last = N.

    Returns:
        (req_weight_indices [bs], token_lora_mapping [N]) as host tuples; an empty request maps to
        ``NO_ADAPTER``.

    Raises:
        InvalidFieldError: offsets that do not cover the segmentation's tokens, or a request whose
            tokens sit in segments of different slots.
    """
    indptr = _as_int_list("req_seg_indptr", req_seg_indptr)
    mapping = segments.token_lora_mapping()
    if not indptr or indptr[0] != 0 or indptr[-1] != len(mapping):
        raise InvalidFieldError("req_seg_indptr", f"must run from 0 to the {len(mapping)} tokens of the segments, "
                                                  f"got {indptr[:1]}..{indptr[-1:]}")
    req_weight_indices = []
    for r in range(len(indptr) - 1):
        slots = {mapping[t] for t in range(indptr[r], indptr[r + 1])}
        if len(slots) > 1:
            raise InvalidFieldError(f"request {r}", f"its tokens sit in segments of slots {sorted(slots)}")
        req_weight_indices.append(slots.pop() if slots else NO_ADAPTER)
    return tuple(req_weight_indices), mapping
