"""The Triton kernels of :mod:`moelora_kernels.fused_moe` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import accumulate_k, accumulate_k_lora


@triton.jit
def _base_and_lora_k(acc, a_ptrs, w_ptrs, row_ok, n_ok, offs_k, offs_n, K, stride_ak, stride_wk,
                     lora_a_ptr, lora_b_ptr, lora_scalings_ptr, slot, expert, rank,
                     stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn, stride_scaling,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x·W_eᵀ + σ_slot · (x·A_{slot,e}ᵀ rounded to x's dtype)·B_{slot,e}ᵀ over the block's rows and
    this program's columns (fp32): x streamed once in the K loop for both W_e and A (t [BLOCK_M,
    BLOCK_R] beside acc), the rank-wide B tile and σ in the epilogue; rank columns >= ``rank`` read 0."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    a_lora_ptrs = (lora_a_ptr + slot * stride_al + expert * stride_ae + offs_r[None, :] * stride_ar
                   + offs_k[:, None])
    acc, t = accumulate_k_lora(acc, tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32), a_ptrs, w_ptrs, a_lora_ptrs,
                               row_ok, n_ok, r_ok, K, BLOCK_K * stride_ak, BLOCK_K * stride_wk,
                               BLOCK_K, DOT_PRECISION, UPCAST)
    # rounding point: t in the activation dtype, as the separate MoE-LoRA kernels store it
    t = t.to(lora_a_ptr.dtype.element_ty)
    b = tl.load(lora_b_ptr + slot * stride_bl + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn
                + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if UPCAST:
        t = t.to(tl.float32)
        b = b.to(tl.float32)
    sigma = tl.load(lora_scalings_ptr + slot * stride_scaling)
    # the delta joins the fp32 sum before bias and router weight: (W h + b + σ B A h) · w
    return acc + tl.dot(t, b, input_precision=DOT_PRECISION) * sigma


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
    # sizes
    N,
    K,
    num_pairs,                    # M * top_k; rows >= it are padding
    in_row_div,                   # top_k when a holds one row per token, else 1
    experts_per_scale,
    experts_per_weight,           # consecutive expert ids reading one weight (stride 0 within)
    num_experts,                  # E_w: blocks of other experts are skipped
    lora_groups,                  # HAS_LORA: L + 1; block id v = expert · (L + 1) + slot (slot L: no LoRA)
    lora_experts,                 # HAS_LORA: E of the LoRA factors (experts >= it get no LoRA)
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
    HAS_LORA: tl.constexpr,       # expert-major (expert, slot) blocks; the slice's delta in the epilogue
    HAS_ENABLED: tl.constexpr,
    BLOCK_R: tl.constexpr,
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
    slot = expert * 0
    if HAS_LORA:
        # an expert-major (expert, slot) block id (virtual_experts.fused_lora_topk_ids)
        slot = expert % lora_groups
        expert = expert // lora_groups
    # -1 blocks, and ids past the weight's E_w (an alignment made for more experts): no weight to read
    if expert >= num_experts:
        return
    rank = slot.to(tl.int32) * 0
    if HAS_LORA:
        # the block's LoRA work: none for the no-LoRA group (slot L), a disabled slot, an expert
        # past the factors' E, a rank-0 module; those blocks run the base GEMM alone, unchanged
        if (slot < lora_groups - 1) & (expert < lora_experts):
            rank = tl.minimum(tl.load(lora_ranks_ptr + slot * stride_rank), rank_bound)
            if HAS_ENABLED:
                if tl.load(adapter_enabled_ptr + slot) == 0:
                    rank = rank * 0
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_LORA:
        if rank > 0:
            acc = _base_and_lora_k(acc, a_ptrs, w_ptrs, row_ok, n_ok, offs_k, offs_n, K, stride_ak, stride_wk,
                                   lora_a_ptr, lora_b_ptr, lora_scalings_ptr, slot, expert, rank,
                                   stride_al, stride_ae, stride_ar, stride_bl, stride_be, stride_bn, stride_scaling,
                                   BLOCK_M, BLOCK_K, BLOCK_R, DOT_PRECISION, UPCAST)
        else:
            acc = accumulate_k(acc, a_ptrs, w_ptrs, row_ok, n_ok, K,
                               BLOCK_K * stride_ak, BLOCK_K * stride_wk, BLOCK_K, DOT_PRECISION, UPCAST)
    else:
        acc = accumulate_k(acc, a_ptrs, w_ptrs, row_ok, n_ok, K,
                           BLOCK_K * stride_ak, BLOCK_K * stride_wk, BLOCK_K, DOT_PRECISION, UPCAST)

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

