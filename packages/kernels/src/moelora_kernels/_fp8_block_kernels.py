"""The Triton kernels of :mod:`moelora_kernels.fp8_block` (the launchers there check every precondition
and document each tensor; DESIGN.md §1, "Quantized base")."""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import wait_for_producers


@triton.jit
def _round_to_e4m3(v):
    """The e4m3 value nearest to each fp32 element of v (|v| <= 448), ties to the even mantissa, in fp32.

    Written out rather than left to a cast (the interpreter's fp32 → fp8 cast rounds ties away from
    zero and mishandles subnormals): the exponent from the bits, the spacing 2^(e-3) (2^-9 below
    2^-6), floor and an explicit tie rule. Every step is exact in fp32.
    """
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a); -127 for 0 and fp32 subnormals
    e = tl.maximum(e, -6)
    spacing = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    n = tl.div_rn(a, spacing)  # exact: a power-of-two division (div_rn: IEEE on every device)
    low = tl.floor(n)
    frac = n - low
    up = (frac > 0.5) | ((frac == 0.5) & ((low.to(tl.int32) & 1) == 1))
    r = tl.where(up, low + 1.0, low) * spacing
    # the sign by a product, not `-r`: Triton negates as 0 - r, which turns a negative value's rounded zero
    # into +0 where the twin (and a cast) give -0 (test_activation_quantization_is_bit_identical_to_the_twin)
    return r * tl.where(v < 0, -1.0, 1.0)


@triton.jit
def _quant_fp8_groups_kernel(
    # pointers
    x_ptr,                        # [rows, K] fp32/fp16/bf16
    q_ptr,                        # [rows, K] float8_e4m3fn (or fp32): the e4m3 values
    s_ptr,                        # [rows, G] fp32 scales
    # sizes
    rows,
    K,
    eps,                          # fp32 floor of a group's amax
    # strides
    stride_xm, stride_qm, stride_sm,
    # meta-parameters
    GROUP: tl.constexpr,          # bk
    BLOCK: tl.constexpr,          # next power of two >= bk
    QUANT_ROWS: tl.constexpr,     # rows per program (each row's groups independent: any value is exact)
    PDL: tl.constexpr,            # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * QUANT_ROWS + tl.arange(0, QUANT_ROWS).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    ok = ((tl.arange(0, BLOCK) < GROUP) & (offs < K))[None, :] & (row < rows)[:, None]
    x = tl.load(x_ptr + row[:, None] * stride_xm + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    # tl.div_rn, not `/`: on a GPU Triton's fp32 `/` is an approximate division (about 1 ulp off), while
    # the contract (DESIGN.md §1) and the twin divide correctly rounded; the GPU matrix's fp8 kernel
    # cell caught 9 of 18 scales one bit off
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), eps), 448.0)
    q = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -448.0), 448.0))
    tl.store(q_ptr + row[:, None] * stride_qm + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g, s, mask=row < rows)


@triton.jit
def _fp8_moe_gemm_kernel(
    # pointers
    q_ptr,                        # [rows_in, K] e4m3 values (fp8 or fp32)
    qs_ptr,                       # [rows_in, G] fp32 activation scales
    w_ptr,                        # [E_w, N, K] float8_e4m3fn
    ws_ptr,                       # [E_w, RB, G] fp32 weight scales (scale_inv)
    c_ptr,                        # [num_pairs, N] (strided)
    sorted_token_ids_ptr,         # [P] int32
    expert_ids_ptr,               # [P // BLOCK_M] int32
    num_tokens_post_padded_ptr,   # [1] int32
    topk_weights_ptr,             # [num_pairs] (MUL_ROUTED_WEIGHT)
    # sizes
    N,
    K,
    num_pairs,
    in_row_div,
    num_experts,
    half,                         # rows per scale grid (I for a fused gate_up, N for one grid)
    half_blocks,                  # ⌈half / bn⌉
    block_n_scale,                # bn
    # strides
    stride_qm, stride_qk, stride_qsm,
    stride_we, stride_wn, stride_wk,
    stride_wse, stride_wsr,
    stride_cm, stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,          # bk: one K step per group
    K_TILE: tl.constexpr,         # the dot's K: max(16, next power of two >= bk), columns past bk masked
    MUL_ROUTED_WEIGHT: tl.constexpr,
    FP8_DOT: tl.constexpr,        # dot the e4m3 tiles as stored (GPU) or widened to fp32 (interpreter)
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,            # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # --- early exits: blocks past the used ones, -1 blocks, experts without a weight ---------------
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    if expert >= num_experts:
        return

    # --- tile ------------------------------------------------------------------------------------
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids_ptr + offs_m)
    row_ok = (pairs >= 0) & (pairs < num_pairs)
    pairs64 = pairs.to(tl.int64)
    a_rows = pairs64 // in_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, K_TILE)
    # each output column's scale row: gate's grid then up's for a fused gate_up (half = I)
    scale_rows = (offs_n // half) * half_blocks + (offs_n % half) // block_n_scale

    # --- pointers --------------------------------------------------------------------------------
    q_ptrs = q_ptr + a_rows[:, None] * stride_qm + offs_k[None, :] * stride_qk
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    ws_ptrs = ws_ptr + expert * stride_wse + scale_rows.to(tl.int64) * stride_wsr

    # --- accumulate in fp32: one K-group at a time, both scales applied to the group's partial sum --
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        k_ok = offs_k < K - g * GROUP
        if K_TILE != GROUP:  # a group narrower than a dot step (or not a power of two): zeros past it
            k_ok = k_ok & (offs_k < GROUP)
        x = tl.load(q_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(x, w)  # e4m3 x e4m3, fp32 accumulation (products exact)
        else:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        sx = tl.load(qs_ptr + a_rows * stride_qsm + g, mask=row_ok, other=0.0)
        sw = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
        acc += (part * sx[:, None]) * sw[None, :]
        q_ptrs += GROUP * stride_qk
        w_ptrs += GROUP * stride_wk

    # --- epilogue: router weight, one rounding ------------------------------------------------------
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pairs64, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    c_ptrs = c_ptr + pairs64[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
