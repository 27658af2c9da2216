"""Dense LoRA (attention q/k/v/o): segmented LoRA-A/B and chunked SGMV shrink/expand.

Both follow y = W x + σ · B (A x) per token (DESIGN.md §1) over *segments*: runs of sorted token
positions that share one adapter slot. Program (segment, tile[, column tile]) takes BLOCK_S
positions of one segment:

    shrink:  t[i_t]   = A[slot] @ x[row(i)]                 (rank-wide, rounded to x's dtype)
    expand:  out[row(i)] += σ[slot] · B[slot] @ t[i_t]        (fp32 epilogue, one rounding)

with ``row(i) = permutation[i]`` when a permutation is given, else ``i``. The two layouts differ
only in where the rank-wide intermediate lives:

- segmented LoRA-A/B (``triton`` backend: one segment per request in EXTEND, one per adapter with a
  permutation in DECODE, 16-token tiles in the prefill graph): ``i_t = row(i)``, the token's own row;
- chunked SGMV (``csgmv``: tokens stably sorted by adapter, cut into chunks, always permuted):
  ``i_t = i``, the sorted position, so the intermediate is read and written contiguously.

Early exits first: a tile past its segment's length, a segment of slot -1 (NO_ADAPTER) or of a
slot outside [0, L), a module rank of 0. Rows they would cover are not touched.

Range contract of the device metadata (what a backend writes; checked in the kernels against the
host ints T and L, because the launchers never read the device): ``weight_indices`` in [-1, L);
``seg_indptr`` non-decreasing within [0, T]; ``permutation`` entries in [0, T). Out-of-range
values add nothing and are never dereferenced: a slot outside [0, L) skips its segment, and a
position outside [0, T) or one whose permutation row lies outside [0, T) is masked (neither read
nor written). The host ``max_len`` must bound every segment's length: positions of a segment past
``max_len`` are not computed (no program covers them; the device cannot tell the host).

Ranks are per slot (mixed in one batch); the rank loop is bounded by the slot's rank (and the host
``max_rank``), so smaller adapters move fewer bytes. Both kernels share the early exits
(``_segment_work``) and the tile's positions and rows (``_segment_rows``); the shrink's K loop is
``_tiles.accumulate_k`` (jit helpers, inlined).

Tensors (T tokens, S segments, L slots, R pool rank):

- ``x`` [T, in], ``out`` [T, out]: last stride 1; T is the token capacity in graph mode.
- ``lora_a`` [L, R, in], ``lora_b`` [L, out, R] (``LoRAWeights.dense_A[m]`` / ``dense_B[m]``).
- ``seg_indptr`` [S + 1] int32 (graph tails equal the last live offset: empty segments),
  ``weight_indices`` [S] int32 (-1 = none), ``permutation`` [T] int64 or None.
- ``ranks`` [L] int32, ``scalings`` [L] fp32: the module's rank and σ per slot.
- ``intermediate`` [T, R] in x's dtype.

Host numbers: ``max_len`` (longest segment; the capacity in graph mode) sizes the tile axis;
S comes from the shape of ``weight_indices``. Rounding: fp32 accumulation (IEEE dots for fp32),
t rounded once to x's dtype, the expand's σ and add in fp32, rounded once.
Source: S-LoRA / Punica SGMV (Chen et al., arXiv:2310.18547; Sheng et al., arXiv:2311.03285) and
SGLang's LoRA backends (``sgemm_lora_a`` / ``sgemm_lora_b``, ``chunked_sgmv`` shrink/expand).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import accumulate_k


@triton.jit
def _segment_work(seg, tile, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, rank_bound, num_slots,
                  BLOCK_S: tl.constexpr):
    """(start, end, slot, rank) of tile ``tile`` of segment ``seg``; rank 0 when the tile has no
    work. The early exits of the module docstring, in its order, each before the next load."""
    start = tl.load(seg_indptr_ptr + seg).to(tl.int64)
    end = tl.load(seg_indptr_ptr + seg + 1).to(tl.int64)
    if tile * BLOCK_S >= end - start:
        return start, end, -1, 0
    slot = tl.load(weight_indices_ptr + seg)
    # NO_ADAPTER, and any slot outside the pool: never an index into ranks, A or B
    if (slot < 0) | (slot >= num_slots):
        return start, end, slot, 0
    rank = tl.minimum(tl.load(ranks_ptr + slot), rank_bound)
    if rank <= 0:
        return start, end, slot, 0
    return start, end, slot, rank


@triton.jit
def _segment_rows(start, end, tile, permutation_ptr, num_tokens, BLOCK_S: tl.constexpr,
                  HAS_PERMUTATION: tl.constexpr):
    """(pos [BLOCK_S] int64, ok, rows): the tile's sorted positions, which of them to compute, and
    the token row each reads (``permutation[pos]``, or ``pos`` without one). A position is ok when it
    lies in the segment and in [0, T) and its row lies in [0, T): offsets or a permutation out of
    range add nothing and are never dereferenced."""
    pos64 = start + tile * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = (pos64 < end) & (pos64 >= 0) & (pos64 < num_tokens)
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + pos64, mask=ok, other=0).to(tl.int64)
        ok = ok & (rows >= 0) & (rows < num_tokens)
    else:
        rows = pos64
    return pos64, ok, rows


@triton.jit
def _dense_lora_shrink_kernel(
    # pointers
    x_ptr, a_ptr, inter_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, permutation_ptr,
    # sizes
    K, R, rank_bound,
    num_tokens,              # T: rows of x, the intermediate and the permutation
    num_slots,               # L: slots of lora_a / ranks
    # strides
    stride_xm, stride_al, stride_ar, stride_im,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, INTER_SORTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    # --- early exits ---------------------------------------------------------------------------
    start, end, slot, rank = _segment_work(seg, tile, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, rank_bound,
                                           num_slots, BLOCK_S)
    if rank <= 0:
        return
    # --- tile ----------------------------------------------------------------------------------
    pos64, pos_ok, rows = _segment_rows(start, end, tile, permutation_ptr, num_tokens, BLOCK_S, HAS_PERMUTATION)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None]
    # --- accumulate in fp32 ----------------------------------------------------------------------
    acc = accumulate_k(tl.zeros([BLOCK_S, BLOCK_R], dtype=tl.float32), x_ptrs, a_ptrs, pos_ok, r_ok, K,
                       BLOCK_K, BLOCK_K, BLOCK_K, DOT_PRECISION, UPCAST)
    # --- epilogue --------------------------------------------------------------------------------
    if INTER_SORTED:
        i_rows = pos64
    else:
        i_rows = rows
    tl.store(inter_ptr + i_rows[:, None] * stride_im + offs_r[None, :], acc.to(inter_ptr.dtype.element_ty),
             mask=pos_ok[:, None] & (offs_r < R)[None, :])


@triton.jit
def _dense_lora_expand_kernel(
    # pointers
    inter_ptr, b_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, scalings_ptr, permutation_ptr,
    # sizes
    N, rank_bound,
    num_tokens,              # T: rows of the intermediate, out and the permutation
    num_slots,               # L: slots of lora_b / ranks / scalings
    # strides
    stride_im, stride_bl, stride_bn, stride_om,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, INTER_SORTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    pid_n = tl.program_id(2)
    # --- early exits ---------------------------------------------------------------------------
    start, end, slot, rank = _segment_work(seg, tile, seg_indptr_ptr, weight_indices_ptr, ranks_ptr, rank_bound,
                                           num_slots, BLOCK_S)
    if rank <= 0:
        return
    # --- tile ----------------------------------------------------------------------------------
    pos64, pos_ok, rows = _segment_rows(start, end, tile, permutation_ptr, num_tokens, BLOCK_S, HAS_PERMUTATION)
    if INTER_SORTED:
        i_rows = pos64
    else:
        i_rows = rows
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    t = tl.load(inter_ptr + i_rows[:, None] * stride_im + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :],
                other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n.to(tl.int64)[None, :] * stride_bn + offs_r[:, None],
                mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if UPCAST:
        t = t.to(tl.float32)
        b = b.to(tl.float32)
    delta = tl.dot(t, b, input_precision=DOT_PRECISION) * tl.load(scalings_ptr + slot)
    # --- epilogue: add in fp32, one rounding -------------------------------------------------------
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n.to(tl.int64)[None, :]
    o_mask = pos_ok[:, None] & n_ok[None, :]
    old = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (old + delta).to(out_ptr.dtype.element_ty), mask=o_mask)
