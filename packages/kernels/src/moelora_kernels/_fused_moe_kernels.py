"""The Triton kernels of :mod:`moelora_kernels.fused_moe` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import accumulate_k, accumulate_k_desc, wait_for_producers


@triton.jit
def _fused_moe_gemm_kernel(
    # pointers
    a_ptr,                        # [rows_in, K]
    w_ptr,                        # [E_w // experts_per_weight, N, K]; W_DESC: a descriptor over its rows [E·N, K]
    c_ptr,                        # [num_pairs, N] (strided)
    sorted_token_ids_ptr,         # [P] int32
    expert_ids_ptr,               # [P // BLOCK_M] int32
    num_tokens_post_padded_ptr,   # [1] int32
    topk_weights_ptr,             # [num_pairs] (MUL_ROUTED_WEIGHT)
    scale_ptr,                    # [E_w // experts_per_scale] fp32 (HAS_SCALE)
    bias_ptr,                     # [E_w, N] per-expert bias (HAS_BIAS; GPT-OSS)
    # sizes
    N,
    K,
    num_pairs,                    # M * top_k; rows >= it are padding
    in_row_div,                   # top_k when a holds one row per token, else 1
    experts_per_scale,
    experts_per_weight,           # consecutive expert ids reading one weight (stride 0 within)
    num_experts,                  # E_w: blocks of other experts are skipped
    # strides
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn,
    stride_bias_e, stride_bias_n,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_INTO: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,         # interpreter + bf16: widen tiles before tl.dot
    GROUP_SIZE_M: tl.constexpr,   # 0: the launch order (row blocks fastest); g > 0: g row blocks x every column tile
    W_DESC: tl.constexpr,         # 1: w_ptr is a TMA descriptor, block [BLOCK_N, BLOCK_K] (fused_moe.weight_descriptor)
    PDL: tl.constexpr,            # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUP_SIZE_M > 0:
        # L2 reuse at large M: programs run in launch order, so take GROUP_SIZE_M row blocks across
        # every column tile before the next group; a block's gathered rows are then read while they
        # are still in L2 instead of once per column tile. A renumbering only: each program still
        # computes one (block, column tile) and every one is computed once.
        num_pid_m = tl.num_programs(0)
        num_pid_n = tl.num_programs(1)
        pid = pid_m + pid_n * num_pid_m
        in_group = GROUP_SIZE_M * num_pid_n
        first_m = (pid // in_group) * GROUP_SIZE_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_SIZE_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
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

    # --- accumulate in fp32 ------------------------------------------------------------------------
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_DESC:
        # the weight's rows [E·N, K] through the descriptor: the tile's columns past N are the next
        # expert's rows (or zero padding after the last), computed and never stored (n_ok below)
        w_row = ((expert // experts_per_weight) * N + pid_n * BLOCK_N).to(tl.int32)
        acc = accumulate_k_desc(acc, a_ptrs, w_ptr, w_row, row_ok, K, BLOCK_K * stride_ak,
                                BLOCK_K, DOT_PRECISION, UPCAST)
    else:
        w_ptrs = (w_ptr + (expert // experts_per_weight) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
                  + offs_k[:, None] * stride_wk)
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

