"""Readable twins of the dense LoRA kernels (``moelora_kernels.sgmv``): segmented LoRA-A/B and
chunked SGMV shrink/expand.

For every segment g with slot l = weight_indices[g] >= 0 and module rank r = min(ranks[l],
max_rank) > 0, and every sorted position i in [seg_indptr[g], seg_indptr[g+1]) with token row
``row(i) = permutation[i]`` (or i without a permutation):

    shrink:  t[i_t, :r] = round(A[l, :r] @ x[row(i)]);  t[i_t, r:] = 0
    expand:  out[row(i)] = round(out[row(i)] + σ[l] · B[l, :, :r] @ t[i_t, :r])

with ``i_t = row(i)`` for segmented LoRA-A/B and ``i_t = i`` for chunked SGMV. Rows of other tokens
are not touched. Any device: the metadata is read once into host lists, the math runs where the
data lives. Source: S-LoRA / Punica SGMV (arXiv:2311.03285, arXiv:2310.18547); SGLang's
``sgemm_lora_a/b`` and ``chunked_sgmv`` LoRA backends. The per-token equation is
:func:`moelora_reference.oracle.dense_lora_forward`.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def _positions(seg_indptr, weight_indices, ranks, permutation, max_rank, R):
    """(slot, rank, sorted positions, token rows) of every segment with an adapter."""
    bound = R if max_rank is None else max_rank
    indptr, slots, rank_of = seg_indptr.tolist(), weight_indices.tolist(), ranks.tolist()
    for g, slot in enumerate(slots):
        start, end = indptr[g], indptr[g + 1]
        if slot < 0 or end <= start:
            continue  # NO_ADAPTER segment, or an empty graph-tail segment
        r = min(rank_of[slot], bound)
        if r <= 0:
            continue
        pos = torch.arange(start, end, device=seg_indptr.device)
        rows = pos if permutation is None else permutation[start:end].to(torch.int64)
        yield slot, r, pos, rows


def _shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, out, max_rank, sorted_inter):
    R = lora_a.shape[1]
    if out is None:
        out = torch.full((x.shape[0], R), float("nan"), dtype=x.dtype, device=x.device)
    for slot, r, pos, rows in _positions(seg_indptr, weight_indices, ranks, permutation, max_rank, R):
        t = torch.zeros(len(rows), R, dtype=F64, device=x.device)
        t[:, :r] = x[rows].to(F64) @ lora_a[slot, :r].to(F64).T  # [n, r]
        out[pos if sorted_inter else rows] = t.to(out.dtype)
    return out


def _expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, max_rank,
            sorted_inter):
    R = lora_b.shape[2]
    for slot, r, pos, rows in _positions(seg_indptr, weight_indices, ranks, permutation, max_rank, R):
        t = intermediate[pos if sorted_inter else rows, :r].to(F64)  # [n, r]
        delta = float(scalings[slot]) * (t @ lora_b[slot, :, :r].to(F64).T)  # [n, N]
        out[rows] = (out[rows].to(F64) + delta).to(out.dtype)
    return out


def segmented_lora_a(x, lora_a, seg_indptr, weight_indices, ranks, *, max_len, permutation=None, out=None,
                     max_rank=None):
    """t[row] = A[slot] @ x[row] per segment (row order). x [T, in], lora_a [L, R, in] → [T, R]
    (NaN-filled when allocated here: rows outside adapter segments stay NaN). ``max_len`` is a
    launch bound of the kernel and does not change the result."""
    return _shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, out, max_rank, False)


def segmented_lora_b(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, out, *, max_len,
                     permutation=None, max_rank=None):
    """out[row] += σ[slot] · B[slot] @ t[row] per segment. intermediate [T, R], lora_b [L, out, R]."""
    return _expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, max_rank,
                   False)


def chunked_sgmv_shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, *, max_len, out=None,
                        max_rank=None):
    """t[i] = A[slot] @ x[permutation[i]] per chunk (sorted order) → [T, R]."""
    return _shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, out, max_rank, True)


def chunked_sgmv_expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, *,
                        max_len, max_rank=None):
    """out[permutation[i]] += σ[slot] · B[slot] @ t[i] per chunk."""
    return _expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, max_rank,
                   True)
