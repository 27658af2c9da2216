"""The Triton kernels of :mod:`moelora_kernels.fused_moe` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import accumulate_k


@triton.jit
def _add_lora_rows(acc, a_ptr, a_rows, row_ok, offs_k, offs_n, n_ok, K, stride_am, stride_ak,
                   mapping_ptr, pairs64, lora_top_k,
                   lora_a_ptr, lora_b_ptr, lora_ranks_ptr, lora_scalings_ptr, adapter_enabled_ptr,
                   expert, lora_slots, rank_bound,
                   stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn, stride_rank, stride_scaling,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   SLOT_GROUP: tl.constexpr, HAS_ENABLED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    """acc with ``σ_s · round_dtype(x·A_{s,e}ᵀ)·B_{s,e}ᵀ`` added to every row whose token has a live
    slot s (its own slot: rows of one block may belong to any slots); other rows keep acc as it is
    (tl.where, so a -0.0 stays -0.0: base rows bit-identical to the LoRA-free launch).

    A row is live when its token's slot is in [0, L), enabled, with rank > 0 (clamped to
    ``rank_bound``) and σ != 0. Slots are taken ``SLOT_GROUP`` at a time: the group's A factors side
    by side as one [BLOCK_K, SLOT_GROUP·BLOCK_R] tile, so one K loop over the block's rows of that
    group makes every row's shrink against all the group's slots; each row keeps the columns of its
    own slot (the others set to 0 before the expand), and one dot with the group's B factors
    [SLOT_GROUP·BLOCK_R, BLOCK_N] expands them. Groups with no live row of the block are skipped,
    so a block of base rows costs one reduction.
    """
    tokens = pairs64 // lora_top_k
    row_slot = tl.load(mapping_ptr + tokens, mask=row_ok, other=-1)
    live = row_ok & (row_slot >= 0) & (row_slot < lora_slots)
    safe_slot = tl.where(live, row_slot, 0).to(tl.int64)
    row_rank = tl.minimum(tl.load(lora_ranks_ptr + safe_slot * stride_rank, mask=live, other=0), rank_bound)
    if HAS_ENABLED:
        live = live & (tl.load(adapter_enabled_ptr + safe_slot, mask=live, other=0) != 0)
    row_sigma = tl.load(lora_scalings_ptr + safe_slot * stride_scaling, mask=live, other=0.0)
    live = live & (row_rank > 0) & (row_sigma != 0.0)
    if tl.sum(live.to(tl.int32), axis=0) > 0:
        offs_c = tl.arange(0, SLOT_GROUP * BLOCK_R)
        c_r = offs_c % BLOCK_R
        delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # groups by division of a non-negative slot (dead rows are masked out of every group)
        row_group = tl.where(live, row_slot, 0) // SLOT_GROUP
        for g in range(0, tl.cdiv(lora_slots, SLOT_GROUP)):
            in_group = live & (row_group == g)
            if tl.sum(in_group.to(tl.int32), axis=0) > 0:
                c_slot = g * SLOT_GROUP + offs_c // BLOCK_R
                c_ok = c_slot < lora_slots
                c_slot64 = tl.where(c_ok, c_slot, 0).to(tl.int64)
                c_rank = tl.minimum(tl.load(lora_ranks_ptr + c_slot64 * stride_rank, mask=c_ok, other=0), rank_bound)
                c_ok = c_ok & (c_r < c_rank)
                x_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
                a_lora_ptrs = (lora_a_ptr + c_slot64[None, :] * stride_al + expert * stride_ae
                               + c_r[None, :] * stride_ar + offs_k[:, None])
                t = accumulate_k(tl.zeros([BLOCK_M, SLOT_GROUP * BLOCK_R], dtype=tl.float32), x_ptrs, a_lora_ptrs,
                                 in_group, c_ok, K, BLOCK_K * stride_ak, BLOCK_K, BLOCK_K, DOT_PRECISION, UPCAST)
                # each row expands its own slot's rank columns only
                t = tl.where(row_slot[:, None] == c_slot[None, :], t, 0.0)
                # rounding point: t in the activation dtype, as the separate MoE-LoRA kernels store it
                t = t.to(lora_a_ptr.dtype.element_ty)
                b = tl.load(lora_b_ptr + c_slot64[:, None] * stride_bl + expert * stride_be
                            + offs_n.to(tl.int64)[None, :] * stride_bn + c_r[:, None],
                            mask=c_ok[:, None] & n_ok[None, :], other=0.0)
                if UPCAST:
                    t = t.to(tl.float32)
                    b = b.to(tl.float32)
                delta = tl.dot(t, b, delta, input_precision=DOT_PRECISION)
        # the delta joins the fp32 sum before bias and router weight: (W h + b + σ B A h) · w
        acc = tl.where(live[:, None], acc + delta * row_sigma[:, None], acc)
    return acc


@triton.jit
def _fused_moe_gemm_kernel(
    # pointers
    a_ptr,                        # [rows_in, K]
    w_ptr,                        # [E_w // experts_per_weight, N, K]
    c_ptr,                        # [num_pairs, N] (strided)
    sorted_token_ids_ptr,         # [P] int32
    expert_ids_ptr,               # [P // BLOCK_M] int32
    num_tokens_post_padded_ptr,   # [1] int32
    topk_weights_ptr,             # [num_pairs] (MUL_ROUTED_WEIGHT)
    scale_ptr,                    # [E_w // experts_per_scale] fp32 (HAS_SCALE)
    bias_ptr,                     # [E_w, N] per-expert bias (HAS_BIAS; GPT-OSS)
    lora_a_ptr,                   # [L, E, R, K] one slice's A (HAS_LORA; K stride 1, expert stride may be 0)
    lora_b_ptr,                   # [L, E, N, R] its B (HAS_LORA; R stride 1)
    lora_ranks_ptr,               # [L] int32 the slice's rank per slot (HAS_LORA)
    lora_scalings_ptr,            # [L] fp32 its σ per slot (HAS_LORA)
    adapter_enabled_ptr,          # [L] int32 (HAS_ENABLED)
    token_lora_mapping_ptr,       # [M] int32 slot per token, -1 none (HAS_LORA)
    # sizes
    N,
    K,
    num_pairs,                    # M * top_k; rows >= it are padding
    in_row_div,                   # top_k when a holds one row per token, else 1
    experts_per_scale,
    experts_per_weight,           # consecutive expert ids reading one weight (stride 0 within)
    num_experts,                  # E_w: blocks of other experts are skipped
    lora_slots,                   # HAS_LORA: L (slots >= it, and -1, get no LoRA)
    lora_experts,                 # HAS_LORA: E of the LoRA factors (experts >= it get no LoRA)
    lora_top_k,                   # HAS_LORA: top_k (a pair's token is pair // top_k)
    rank_bound,                   # HAS_LORA: host bound on every slot's rank (<= BLOCK_R)
    # strides
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn,
    stride_bias_e, stride_bias_n,
    stride_al, stride_ae, stride_ar,
    stride_bl, stride_be, stride_bn,
    stride_rank, stride_scaling,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_INTO: tl.constexpr,
    HAS_LORA: tl.constexpr,       # each row's own slot's delta of the slice, before the epilogue
    HAS_ENABLED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOT_GROUP: tl.constexpr,     # HAS_LORA: slots per shrink/expand tile pair
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,         # interpreter + bf16: widen tiles before tl.dot
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # --- early exits: blocks past the used ones, and -1 blocks ------------------------------------
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    # ids past the weight's E_w (an alignment made for more experts): no weight to read
    if expert >= num_experts:
        return
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + expert // experts_per_scale).to(tl.float32)
        # σ == 0 (a module the slot's adapter lacks): nothing to add, and adding +0.0 would still turn
        # a -0.0 output into +0.0; exit so those rows stay bit-identical, like -1 blocks
        if ADD_INTO:
            if scale == 0.0:
                return

    # --- tile ------------------------------------------------------------------------------------
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids_ptr + offs_m)
    row_ok = (pairs >= 0) & (pairs < num_pairs)
    pairs64 = pairs.to(tl.int64)
    a_rows = pairs64 // in_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    # --- pointers --------------------------------------------------------------------------------
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (w_ptr + (expert // experts_per_weight) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
              + offs_k[:, None] * stride_wk)

    # --- accumulate in fp32 ------------------------------------------------------------------------
    # the base sum is the same code with or without LoRA: rows that get no delta are bit-identical
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = accumulate_k(acc, a_ptrs, w_ptrs, row_ok, n_ok, K,
                       BLOCK_K * stride_ak, BLOCK_K * stride_wk, BLOCK_K, DOT_PRECISION, UPCAST)
    if HAS_LORA:
        if expert < lora_experts:
            acc = _add_lora_rows(acc, a_ptr, a_rows, row_ok, offs_k, offs_n, n_ok, K, stride_am, stride_ak,
                                 token_lora_mapping_ptr, pairs64, lora_top_k,
                                 lora_a_ptr, lora_b_ptr, lora_ranks_ptr, lora_scalings_ptr, adapter_enabled_ptr,
                                 expert, lora_slots, rank_bound,
                                 stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn, stride_rank,
                                 stride_scaling, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, SLOT_GROUP, HAS_ENABLED,
                                 DOT_PRECISION, UPCAST)

    # --- epilogue: bias, router weight, scale, add, one rounding ------------------------------------
    if HAS_BIAS:
        # the expert's bias joins the GEMM before the router weight: (W h + b) · w (DESIGN.md §1)
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n.to(tl.int64) * stride_bias_n, mask=n_ok,
                       other=0.0).to(tl.float32)
        acc += bias[None, :]
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    if HAS_SCALE:
        acc = acc * scale
    c_ptrs = c_ptr + pairs64[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    c_mask = row_ok[:, None] & n_ok[None, :]
    if ADD_INTO:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

