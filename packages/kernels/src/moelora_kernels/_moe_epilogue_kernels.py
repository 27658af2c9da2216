"""The Triton kernels of :mod:`moelora_kernels.moe_epilogue` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import wait_for_producers


@triton.jit
def _act(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        return x * tl.sigmoid(x)
    else:
        # GELU, tanh form: 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))), with tanh(z) = 2σ(2z) - 1
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * tl.sigmoid(2.0 * z)


@triton.jit
def _moe_activation_kernel(
    # pointers
    gate_up_ptr,     # [rows, 2I] (GATED) or [rows, I]
    h_ptr,           # [rows, I], out
    topk_ids_ptr,    # [rows] expert id per pair (HAS_IDS)
    # sizes
    inter,           # I
    alpha,           # swiglu_oai: the sigmoid's slope α (fp32)
    limit,           # swiglu_oai: the clamp bound (fp32)
    # strides
    stride_gm, stride_hm,
    # meta-parameters
    BLOCK: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_IDS: tl.constexpr,
    PDL: tl.constexpr,           # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    if HAS_IDS:
        if tl.load(topk_ids_ptr + row) < 0:
            return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g_cols = cols
    u_cols = inter + cols
    g = tl.load(gate_up_ptr + row * stride_gm + g_cols, mask=ok, other=0.0).to(tl.float32)
    if ACTIVATION == "swiglu_oai":
        # GPT-OSS (transformers GptOssExperts._apply_gate): min(g, L) · σ(α min(g, L)) · (clamp(u, ±L) + 1)
        u = tl.load(gate_up_ptr + row * stride_gm + u_cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g * tl.sigmoid(alpha * g) * (u + 1.0)
    else:
        h = _act(g, ACTIVATION)
        if GATED:
            u = tl.load(gate_up_ptr + row * stride_gm + u_cols, mask=ok, other=0.0).to(tl.float32)
            h = h * u
    tl.store(h_ptr + row * stride_hm + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_sum_kernel(
    # pointers
    down_out_ptr,    # [M, top_k, H]
    topk_ids_ptr,    # [M, top_k]
    y_ptr,           # [M, H], out
    # sizes
    hidden,
    top_k,
    # strides
    stride_dm, stride_dk, stride_ym,
    # meta-parameters
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,           # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        here = tl.load(topk_ids_ptr + t * top_k + j) >= 0
        v = tl.load(down_out_ptr + t * stride_dm + j * stride_dk + cols, mask=ok & here, other=0.0)
        # where, not a multiply: an unwritten row of an EXPERT_NOT_HERE pair may hold NaN
        acc += tl.where(here, v.to(tl.float32), 0.0)
    tl.store(y_ptr + t * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)
