"""Triton kernels of the fused MoE-LoRA delta: shrink, expand, and shrink+expand fused per block.

Every program owns one alignment block (BLOCK_M rows of one (slot, expert)) of one slice. Axis 0 of
the grid is one flat axis over the used blocks of all slots, slot-major: program i finds its slot
from the cumulative ``num_tokens_post_padded // BLOCK_M`` (one [BLOCK_L] load), so the grid needs
only the host's bound on the total, ``num_pairs // BLOCK_M + min(E · L, num_pairs)``, each slot's
blocks clamped to the host's per-slot bound:

- shrink:  t[s, p, :]  = A[s, slot, e] · in[p // in_row_div]                  (rank-wide, rounded to dtype)
- expand:  out[p, s·N + n] += σ[s, slot] · w_p · (B[s, slot, e] · t[s, p])[n]
- fused:   both in one program: the rank-wide t stays in registers, then the program walks its
  share of the N columns (``N_SPLIT`` programs share one block's columns and each recompute t),
  each column tile's B and old output loaded as the config key ``EXPAND_LOADS`` says: 0, B at the
  tile and the old output after the dot; 1, both together at the tile; 2, both one tile ahead (same
  values, same order of arithmetic: bit-identical results).
  ``EXPAND_STAGES`` > 1 runs the loads-at-the-tile order under the compiler's software pipeliner
  instead: each column tile's B and old output are copied into shared memory (cp.async)
  ``EXPAND_STAGES`` - 1 tiles ahead, so a program streams its B factor rather than waiting one memory
  round trip per tile (``EXPAND_LOADS`` is then not used; same values, same order of arithmetic).

Slices: stage "gate_up" has two (s = 0 gate, 1 up), each with its own A and B, writing column
``s·stride_os + n·stride_on`` = ``s·N + n`` of gate_up_out (the "halves" layout: columns
[s·N, (s+1)·N)); stage "down" has one, router-weighted (w_p), writing down_out.

Early exits, before any load of activations or weights: a disabled slot, a module rank of 0, a
block at or past the slot's ``num_tokens_post_padded``, a block of expert -1 (or an id >= E, never
produced by the alignment). Their output rows are not touched (bit-identical). The metadata these
checks read, and the block's row of ``sorted_token_ids``, lie in bounds whatever they hold, so a
program loads them all at once (one memory round trip before the exit, not one per check).
Range contract: rows of ``sorted_token_ids`` outside [0, num_pairs) are padding (never read or
written), expert ids outside [0, E) skip their block, so a corrupt alignment adds nothing and
dereferences nothing outside the tensors; the launchers refuse an alignment recorded for another
pair count on the host (``AlignOutput.num_pairs``: its padding sentinel would be a real pair).
The rank loop bound is the slot's own rank (columns past it are masked, never loaded), so a pool
of R = 64 serving rank-16 adapters moves rank-16 bytes. The expand's factor tiles (t and B) run
along the rank, their contiguous dimension, so a mask at the exact rank varies inside every 16-byte
vector and the compiler splits their loads into 2-byte ones (and cannot copy them asynchronously).
With ``RANK_ALIGN`` = 8 (the config key ``EXPAND_STREAM`` >= 1, pools whose R is a multiple of 8) the
load mask is the rank rounded up to 8 columns, which stays inside R, so the loads are 16 bytes wide;
the up to 7 columns past the rank are set to 0 in registers before the dot (whatever the pool or the
intermediate holds there, NaN included), so the operands, and the results, are those of the exact
mask bit for bit. With ``A_DESC`` (shrink and fused kernel) a block whose slot's rank equals BLOCK_R
reads its A tiles through a TMA descriptor over the pool's rows [S·L·E·R, K] (box [BLOCK_R, BLOCK_K]:
exactly the slot's rank rows; ``moe_lora`` module docstring). With ``PDL`` (config key ``PDL``, sm_90)
a kernel is launched with programmatic dependent launch and every program first waits for the
stream's previous grid (``_tiles.wait_for_producers``), before the early exits' loads. The three
kernels share the early exits (``_block_work``) and the block's pairs (``_block_pairs``); the shrink
and the fused kernel share the shrink (``_shrink_block``, over ``_tiles.accumulate_k`` /
``accumulate_k_desc``): jit helpers, inlined at compile time.

Tensors (L slots, E experts, R pool rank, P alignment rows per slot, S slices, K input width,
N output width per slice, num_pairs = M · top_k):

- ``x`` [M, K] (gate_up, in_row_div = top_k) or [num_pairs, K] (down, in_row_div = 1); last stride 1.
- ``lora_a`` [S, L, E, R, K], ``lora_b`` [S, L, E, N, R]: last stride 1, same dtype as x.
- ``ranks`` [S, L] int32, ``scalings`` [S, L] fp32: the per-module rank and σ per slot
  (``LoRAWeights.module_ranks`` / ``module_scalings`` rows), strided views are fine.
- ``intermediate`` [S, num_pairs, R] in x's dtype; rows of handled pairs only.
- ``out`` [num_pairs, S·N] (a view of [M, top_k, S·N]), last stride 1: added into in place.
- ``topk_weights`` [num_pairs] fp32 (or x's dtype): router weights (down only).
- alignment: ``sorted_token_ids`` [L, P], ``expert_ids`` [L, P // BLOCK_M], ``num_tokens_post_padded`` [L].
- ``adapter_enabled`` [L] int32.

Rounding: dots accumulate in fp32 (IEEE for fp32 unless TF32 is asked for); t is rounded once to
the activation dtype (as the public kernels store it); the expand epilogue multiplies by σ and w_p in
fp32, adds the old output value in fp32 and rounds once. Offsets of rows, slots, experts
and columns are 64-bit (products like pair · 2I or slot · E · R · H can pass 2^31).

Source: vLLM's fused MoE-LoRA (``fused_moe_lora``, vllm-project/vllm#21229) and SGLang's MoE-LoRA
(sgl-project/sglang#14105); the fusion of shrink and expand per block is moelora's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import accumulate_k, accumulate_k_desc, wait_for_producers


@triton.jit
def _block_work(pid_m, slot, s, ntpp, expert_ids_ptr, adapter_enabled_ptr, ranks_ptr,
                rank_bound, num_experts, stride_expert_ids, stride_rank_s,
                BLOCK_M: tl.constexpr, HAS_ENABLED: tl.constexpr):
    """(rank, expert) of alignment block ``pid_m`` of ``slot`` in slice ``s`` (``ntpp``: the slot's
    ``num_tokens_post_padded``); rank 0 and expert -1 when the block has no work (the early exits of
    the module docstring). Every load here is in bounds whatever the metadata holds (slot < L, pid_m
    below the host's per-slot bound, which is at most the alignment's blocks), so they are issued
    together: the exits cost one memory round trip, not one per check."""
    # the host bound keeps a corrupt device rank from reading past R
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rank_s + slot), rank_bound)
    expert = tl.load(expert_ids_ptr + slot.to(tl.int64) * stride_expert_ids + pid_m)
    ok = (rank > 0) & (pid_m * BLOCK_M < ntpp) & (expert >= 0) & (expert < num_experts)
    if HAS_ENABLED:
        ok = ok & (tl.load(adapter_enabled_ptr + slot) != 0)
    return tl.where(ok, rank, 0), tl.where(ok, expert, -1)


@triton.jit
def _flat_block(pid, num_tokens_post_padded_ptr, L, slot_blocks_bound,
                BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
    """(pid_m, slot) of flat program ``pid``: the slots' used blocks laid end to end, slot-major, each
    slot's count ``num_tokens_post_padded // BLOCK_M`` clamped to [0, ``slot_blocks_bound``] (the
    host's per-slot bound, so a corrupt count runs no block past a slot's alignment). A program past
    the last used block gets slot = L (no work). Also returns the
    slot's own (unclamped) count, from the same load."""
    offs_l = tl.arange(0, BLOCK_L)
    ntpp = tl.load(num_tokens_post_padded_ptr + offs_l, mask=offs_l < L, other=0)
    blocks = tl.minimum(tl.maximum(ntpp // BLOCK_M, 0), slot_blocks_bound)
    ends = tl.cumsum(blocks, 0)
    # the slot is the number of slots whose blocks all lie before pid; its start, their sum
    slot = tl.sum((ends <= pid).to(tl.int32), 0)
    start = tl.sum(tl.where(ends <= pid, blocks, 0), 0)
    return pid - start, slot, tl.sum(tl.where(offs_l == slot, ntpp, 0), 0)


@triton.jit
def _rank_load_mask(offs_r, rank, RANK_ALIGN: tl.constexpr):
    """The rank columns a factor tile loads: ``offs_r < rank`` rounded up to a multiple of
    ``RANK_ALIGN`` (1: the exact rank), so the mask is constant over each vector of RANK_ALIGN
    columns (module docstring); the launcher gives RANK_ALIGN > 1 only where R is its multiple."""
    if RANK_ALIGN == 1:
        return offs_r < rank
    return offs_r < tl.multiple_of((rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN, RANK_ALIGN)


@triton.jit
def _block_pairs(sorted_token_ids_ptr, pid_m, slot, num_pairs, stride_sorted, BLOCK_M: tl.constexpr):
    """(pairs [BLOCK_M] int64, row_ok): the pairs of block ``pid_m`` of ``slot``; padding rows
    (``pairs >= num_pairs``) and negative entries (never written by the alignment) are not ok."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids_ptr + slot.to(tl.int64) * stride_sorted + offs_m).to(tl.int64)
    return pairs, (pairs >= 0) & (pairs < num_pairs)


@triton.jit
def _shrink_block(x_ptr, a_ptr, a_desc, pairs, row_ok, offs_r, r_ok, rank, s, slot, expert, K, in_row_div,
                  stride_xm, stride_as, stride_al, stride_ae, stride_ar, L, num_experts, R,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  A_DESC: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32: in[pair // in_row_div] · A[s, slot, expert]ᵀ over K for the block's
    pairs (rows not ok and rank columns not ok read 0). ``A_DESC``: a block whose slot's rank is
    BLOCK_R reads its A tiles [BLOCK_R, BLOCK_K] through ``a_desc``, a 2-D descriptor over the pool's
    rows [S·L·E·R, K] (``moe_lora.lora_a_descriptor``), whose box is then exactly the slot's rank rows;
    a smaller rank keeps the masked pointer loads (so a rank-16 adapter in an R = 64 pool moves rank-16
    bytes either way)."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // in_row_div)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    a_ptrs = (a_ptr + s.to(tl.int64) * stride_as + slot.to(tl.int64) * stride_al + expert * stride_ae
              + offs_r[None, :] * stride_ar + offs_k[:, None])
    if A_DESC:
        if rank == BLOCK_R:
            # int32 row of the slot's first rank row: bounded on the host (S·L·E·R + BLOCK_R < 2^31)
            a_row = ((s * L + slot) * num_experts + expert.to(tl.int32)) * R
            acc = accumulate_k_desc(acc, x_ptrs, a_desc, a_row, row_ok, K, BLOCK_K, BLOCK_K, DOT_PRECISION,
                                    UPCAST)
        else:
            acc = accumulate_k(acc, x_ptrs, a_ptrs, row_ok, r_ok, K, BLOCK_K, BLOCK_K, BLOCK_K, DOT_PRECISION,
                               UPCAST)
    else:
        acc = accumulate_k(acc, x_ptrs, a_ptrs, row_ok, r_ok, K, BLOCK_K, BLOCK_K, BLOCK_K, DOT_PRECISION, UPCAST)
    return acc


@triton.jit
def _moe_lora_shrink_kernel(
    # pointers
    x_ptr, a_ptr, a_desc, inter_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, adapter_enabled_ptr, ranks_ptr,
    # sizes
    K, R, rank_bound, num_pairs, in_row_div, num_experts,
    # strides
    stride_xm,
    stride_as, stride_al, stride_ae, stride_ar,
    stride_is, stride_im,
    stride_sorted, stride_expert_ids, stride_rank_s,
    L, slot_blocks_bound,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    A_DESC: tl.constexpr, PDL: tl.constexpr,
    HAS_ENABLED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    wait_for_producers(PDL)
    s = tl.program_id(2)
    # --- early exits (the block's pairs are loaded with the checks' metadata: one round trip) ---------
    pid_m, slot, ntpp = _flat_block(tl.program_id(0), num_tokens_post_padded_ptr, L, slot_blocks_bound,
                                    BLOCK_M, BLOCK_L)
    if slot >= L:
        return
    rank, expert = _block_work(pid_m, slot, s, ntpp, expert_ids_ptr, adapter_enabled_ptr,
                               ranks_ptr, rank_bound, num_experts, stride_expert_ids, stride_rank_s,
                               BLOCK_M, HAS_ENABLED)
    pairs, row_ok = _block_pairs(sorted_token_ids_ptr, pid_m, slot, num_pairs, stride_sorted, BLOCK_M)
    if rank <= 0:
        return
    expert = expert.to(tl.int64)
    # --- tile ----------------------------------------------------------------------------------
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    # --- accumulate in fp32 ----------------------------------------------------------------------
    acc = _shrink_block(x_ptr, a_ptr, a_desc, pairs, row_ok, offs_r, r_ok, rank, s, slot, expert, K, in_row_div,
                        stride_xm, stride_as, stride_al, stride_ae, stride_ar, L, num_experts, R,
                        BLOCK_M, BLOCK_R, BLOCK_K, A_DESC, DOT_PRECISION, UPCAST)
    # --- epilogue: the activation dtype (one rounding) -----------------------------------------------
    i_ptrs = inter_ptr + s.to(tl.int64) * stride_is + pairs[:, None] * stride_im + offs_r[None, :]
    tl.store(i_ptrs, acc.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_r < R)[None, :])


@triton.jit
def _moe_lora_expand_kernel(
    # pointers
    inter_ptr, b_ptr, out_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, adapter_enabled_ptr, ranks_ptr, scalings_ptr,
    # sizes
    N, rank_bound, num_pairs, num_experts, num_n_tiles,
    # strides
    stride_is, stride_im,
    stride_bs, stride_bl, stride_be, stride_bn,
    stride_om, stride_os, stride_on,   # out column of (slice s, n): s·stride_os + n·stride_on
    stride_sorted, stride_expert_ids, stride_rank_s, stride_scaling_s,
    L, slot_blocks_bound,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    RANK_ALIGN: tl.constexpr, PDL: tl.constexpr,
    HAS_ENABLED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    wait_for_producers(PDL)
    s = tl.program_id(2) // num_n_tiles
    pid_n = tl.program_id(2) % num_n_tiles
    # --- early exits (the block's pairs are loaded with the checks' metadata: one round trip) ---------
    pid_m, slot, ntpp = _flat_block(tl.program_id(0), num_tokens_post_padded_ptr, L, slot_blocks_bound,
                                    BLOCK_M, BLOCK_L)
    if slot >= L:
        return
    rank, expert = _block_work(pid_m, slot, s, ntpp, expert_ids_ptr, adapter_enabled_ptr,
                               ranks_ptr, rank_bound, num_experts, stride_expert_ids, stride_rank_s,
                               BLOCK_M, HAS_ENABLED)
    pairs, row_ok = _block_pairs(sorted_token_ids_ptr, pid_m, slot, num_pairs, stride_sorted, BLOCK_M)
    if rank <= 0:
        return
    expert = expert.to(tl.int64)
    # --- tile ----------------------------------------------------------------------------------
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    r_ld = _rank_load_mask(offs_r, rank, RANK_ALIGN)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # --- the rank-wide input and the B tile (RANK_ALIGN > 1: columns past the rank read, then set
    # to 0) -------------------------------------------------------------------------------------------
    t_ptrs = inter_ptr + s.to(tl.int64) * stride_is + pairs[:, None] * stride_im + offs_r[None, :]
    t_mask = row_ok[:, None] & r_ld[None, :]
    t = tl.load(t_ptrs, mask=t_mask, other=0.0)
    b = tl.load(b_ptr + s.to(tl.int64) * stride_bs + slot.to(tl.int64) * stride_bl + expert * stride_be
                + offs_n.to(tl.int64)[None, :] * stride_bn + offs_r[:, None],
                mask=r_ld[:, None] & n_ok[None, :], other=0.0)
    if RANK_ALIGN > 1:
        t = tl.where(r_ok[None, :], t, 0.0)
        b = tl.where(r_ok[:, None], b, 0.0)
    # the old output, σ and the router weights are loaded with t and B (before the dot): one round trip
    o_ptrs = (out_ptr + pairs[:, None] * stride_om + s.to(tl.int64) * stride_os
              + offs_n.to(tl.int64)[None, :] * stride_on)
    o_mask = row_ok[:, None] & n_ok[None, :]
    old = tl.load(o_ptrs, mask=o_mask, other=0.0)
    sigma = tl.load(scalings_ptr + s * stride_scaling_s + slot)
    if MUL_ROUTED_WEIGHT:
        w_p = tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    if UPCAST:
        t = t.to(tl.float32)
        b = b.to(tl.float32)
    delta = tl.dot(t, b, input_precision=DOT_PRECISION)
    # --- epilogue: σ, router weight, add, one rounding ------------------------------------------------
    delta = delta * sigma
    if MUL_ROUTED_WEIGHT:
        delta = delta * w_p[:, None]
    tl.store(o_ptrs, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _load_b(b_base, offs_r, r_ld, r_ok, offs_n, n_ok, stride_bn, RANK_ALIGN: tl.constexpr):
    """B tile [BLOCK_R, BLOCK_N] of one column tile from ``b_base``: rank columns ``r_ld`` loaded
    (``_rank_load_mask``), those past ``r_ok`` then set to 0 (RANK_ALIGN > 1), columns not ``n_ok``
    read 0."""
    b = tl.load(b_base + offs_n.to(tl.int64)[None, :] * stride_bn + offs_r[:, None],
                mask=r_ld[:, None] & n_ok[None, :], other=0.0)
    if RANK_ALIGN > 1:
        b = tl.where(r_ok[:, None], b, 0.0)
    return b


@triton.jit
def _expand_load(b_base, o_base, offs_r, r_ld, r_ok, offs_n, n_ok, row_ok, stride_bn, stride_on,
                 RANK_ALIGN: tl.constexpr):
    """(B tile [BLOCK_R, BLOCK_N], old output tile [BLOCK_M, BLOCK_N]) of one column tile of one
    slice: the B tile from ``b_base`` (``_load_b``: rank ``offs_r``, loaded where ``r_ld``, kept where
    ``r_ok``), the output rows not ``row_ok`` and columns not ``n_ok`` read 0 (so a tile past the
    program's range loads nothing)."""
    b = _load_b(b_base, offs_r, r_ld, r_ok, offs_n, n_ok, stride_bn, RANK_ALIGN)
    old = tl.load(o_base + offs_n.to(tl.int64)[None, :] * stride_on, mask=row_ok[:, None] & n_ok[None, :],
                  other=0.0)
    return b, old


@triton.jit
def _expand_tile(t, b, old, o_base, offs_n, n_ok, row_scale, row_ok, stride_on,
                 DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows, n] = fma(t · b, row_scale, old) for one column tile loaded by ``_expand_load``
    (rows not ``row_ok`` are not written).

    One explicit fma, not ``old + delta``: the compiler contracts a multiply and an add into an fma
    or not depending on the code around them, so the three ``EXPAND_LOADS`` orders rounded the fp32
    sum differently on the H200 (test_kernel_expand_loads: 1 ulp apart, seed 13093); the fma
    rounds once in every order."""
    if UPCAST:
        b = b.to(tl.float32)
    _expand_store(tl.dot(t, b, input_precision=DOT_PRECISION), old, o_base, offs_n, n_ok, row_scale, row_ok,
                  stride_on)


@triton.jit
def _expand_store(acc, old, o_base, offs_n, n_ok, row_scale, row_ok, stride_on):
    """Store fma(acc, row_scale, old) (fp32, rounded once, then to the output dtype) at the tile's
    rows ``row_ok`` and columns ``n_ok``: the one rounding every ``EXPAND_LOADS`` order shares."""
    tl.store(o_base + offs_n.to(tl.int64)[None, :] * stride_on,
             tl.fma(acc, row_scale[:, None], old.to(tl.float32)).to(o_base.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _expand_tile_late(t, b_base, o_base, offs_r, r_ld, r_ok, offs_n, n_ok, row_scale, row_ok, stride_bn, stride_on,
                      RANK_ALIGN: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """As ``_expand_load`` then ``_expand_tile``, with the old output loaded after the dot (the
    order before the loads were batched; ``EXPAND_LOADS`` 0)."""
    b = _load_b(b_base, offs_r, r_ld, r_ok, offs_n, n_ok, stride_bn, RANK_ALIGN)
    if UPCAST:
        b = b.to(tl.float32)
    acc = tl.dot(t, b, input_precision=DOT_PRECISION)
    old = tl.load(o_base + offs_n.to(tl.int64)[None, :] * stride_on, mask=row_ok[:, None] & n_ok[None, :],
                  other=0.0)
    _expand_store(acc, old, o_base, offs_n, n_ok, row_scale, row_ok, stride_on)


@triton.jit
def _fused_moe_lora_kernel(
    # pointers
    x_ptr, a_ptr, a_desc, b_ptr, out_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, adapter_enabled_ptr, ranks_ptr, scalings_ptr,
    # sizes
    K, N, R, rank_bound, num_pairs, in_row_div, num_experts,
    # strides
    stride_xm,
    stride_as, stride_al, stride_ae, stride_ar,
    stride_bs, stride_bl, stride_be, stride_bn,
    stride_om, stride_os, stride_on,   # out column of (slice s, n): s·stride_os + n·stride_on
    stride_sorted, stride_expert_ids, stride_rank_s, stride_scaling_s,
    L, slot_blocks_bound,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    N_SPLIT: tl.constexpr, BLOCK_L: tl.constexpr,
    EXPAND_LOADS: tl.constexpr, RANK_ALIGN: tl.constexpr, EXPAND_STAGES: tl.constexpr, A_DESC: tl.constexpr,
    PDL: tl.constexpr, HAS_ENABLED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    wait_for_producers(PDL)
    s = tl.program_id(2) // N_SPLIT
    part = tl.program_id(2) % N_SPLIT
    pid_m, slot, ntpp = _flat_block(tl.program_id(0), num_tokens_post_padded_ptr, L, slot_blocks_bound,
                                    BLOCK_M, BLOCK_L)
    if slot >= L:
        return
    # --- early exits (the block's pairs are loaded with the checks' metadata: one round trip) ---------
    rank, expert = _block_work(pid_m, slot, s, ntpp, expert_ids_ptr, adapter_enabled_ptr,
                               ranks_ptr, rank_bound, num_experts, stride_expert_ids, stride_rank_s,
                               BLOCK_M, HAS_ENABLED)
    pairs, row_ok = _block_pairs(sorted_token_ids_ptr, pid_m, slot, num_pairs, stride_sorted, BLOCK_M)
    if rank <= 0:
        return
    expert = expert.to(tl.int64)
    # --- tile ----------------------------------------------------------------------------------
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    r_ld = _rank_load_mask(offs_r, rank, RANK_ALIGN)   # the expand's B columns loaded
    # --- shrink: t = in · Aᵀ over K, fp32 accumulation -------------------------------------------------
    acc = _shrink_block(x_ptr, a_ptr, a_desc, pairs, row_ok, offs_r, r_ok, rank, s, slot, expert, K, in_row_div,
                        stride_xm, stride_as, stride_al, stride_ae, stride_ar, L, num_experts, R,
                        BLOCK_M, BLOCK_R, BLOCK_K, A_DESC, DOT_PRECISION, UPCAST)
    # rounding point: t in the activation dtype, as the unfused path stores it
    t = acc.to(x_ptr.dtype.element_ty)
    if UPCAST:
        t = t.to(tl.float32)
    # --- expand over this program's share of the N columns --------------------------------------------
    sigma = tl.load(scalings_ptr + s * stride_scaling_s + slot)
    if MUL_ROUTED_WEIGHT:
        row_scale = sigma * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    else:
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + sigma
    b_base = b_ptr + s.to(tl.int64) * stride_bs + slot.to(tl.int64) * stride_bl + expert * stride_be
    o_base = out_ptr + pairs[:, None] * stride_om + s.to(tl.int64) * stride_os
    tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_part = tl.cdiv(tiles, N_SPLIT)
    tile_lo = part * tiles_per_part
    tile_hi = tl.minimum(tiles, tile_lo + tiles_per_part)
    if EXPAND_STAGES == 1 and EXPAND_LOADS == 2:
        # each tile's B and old output loaded one tile ahead (without it, or EXPAND_STAGES, the
        # compiler's pipeliner leaves them serial, one memory round trip per tile: the old output
        # does not feed the dot, and B at the exact rank mask comes in 2-byte loads, too narrow
        # for cp.async); a tile past this program's range is masked off, so it loads nothing.
        # Costs registers for the second set of tiles: a win where programs are few (small M;
        # benchmarks/RESULTS.md, H200 2026-12-04)
        offs_n = tile_lo * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < N) & (tile_lo < tile_hi)
        b, old = _expand_load(b_base, o_base, offs_r, r_ld, r_ok, offs_n, n_ok, row_ok, stride_bn, stride_on,
                              RANK_ALIGN)
        for tile in range(tile_lo, tile_hi):
            next_n = offs_n + BLOCK_N
            next_ok = (next_n < N) & (tile + 1 < tile_hi)
            next_b, next_old = _expand_load(b_base, o_base, offs_r, r_ld, r_ok, next_n, next_ok, row_ok, stride_bn,
                                            stride_on, RANK_ALIGN)
            _expand_tile(t, b, old, o_base, offs_n, n_ok, row_scale, row_ok, stride_on, DOT_PRECISION, UPCAST)
            b, old = next_b, next_old
            offs_n, n_ok = next_n, next_ok
    elif EXPAND_STAGES == 1 and EXPAND_LOADS == 0:
        # B at the tile, the old output after the dot: two round trips per tile
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            _expand_tile_late(t, b_base, o_base, offs_r, r_ld, r_ok, offs_n, n_ok, row_scale, row_ok, stride_bn,
                              stride_on, RANK_ALIGN, DOT_PRECISION, UPCAST)
    else:
        # each tile's B and old output loaded together at the tile (EXPAND_LOADS 1): one round trip
        # per tile; or, EXPAND_STAGES > 1, the same loop software-pipelined by the compiler, B and the
        # old output copied into shared memory EXPAND_STAGES - 1 tiles ahead (cp.async; it takes B
        # only as 16-byte vectors, so RANK_ALIGN 8 is what lets it stream the factor)
        for tile in tl.range(tile_lo, tile_hi, num_stages=EXPAND_STAGES if EXPAND_STAGES > 1 else None):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            b, old = _expand_load(b_base, o_base, offs_r, r_ld, r_ok, offs_n, n_ok, row_ok, stride_bn, stride_on,
                                  RANK_ALIGN)
            _expand_tile(t, b, old, o_base, offs_n, n_ok, row_scale, row_ok, stride_on, DOT_PRECISION, UPCAST)
