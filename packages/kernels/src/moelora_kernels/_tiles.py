"""Triton helpers shared by the kernel files (``@triton.jit`` functions called from kernels).

Triton inlines a jit function into the kernel that calls it, so a helper costs nothing at run time:
the kernels compile to the same code as with the body written in place. Each helper here is a step
that several kernels take the same way.

- :func:`accumulate_k`: the fp32 reduction over K of a gathered row tile and a weight tile, in
  ``BLOCK_K`` steps (base grouped GEMM and its fused LoRA shrink, MoE-LoRA shrink, fused MoE-LoRA,
  dense LoRA shrink).
- :func:`accumulate_k_desc`: the same reduction with the weight tiles read through a TMA tensor
  descriptor (base grouped GEMM, config key ``W_DESC``; MoE-LoRA shrink and fused kernel, ``A_DESC``).
- :func:`wait_for_producers`: the first step of a kernel launched with programmatic dependent launch
  (config key ``PDL``: every kernel of the fused MoE layer, ``_common.PDL_OPS``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def accumulate_k(acc, x_ptrs, w_ptrs, row_ok, col_ok, K, step_x, step_w,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc += Σ over k < K of x[:, k] · w[k, :], in ``BLOCK_K`` steps; returns acc.

    Args:
        acc: [ROWS, COLS] fp32 accumulator.
        x_ptrs: [ROWS, BLOCK_K] pointers to the rows' first K step; w_ptrs: [BLOCK_K, COLS]
            pointers to the weight's first K step.
        row_ok: [ROWS] rows to load (others read 0); col_ok: [COLS] weight columns to load.
        K: reduction length (columns past it read 0).
        step_x, step_w: pointer increments per K step (``BLOCK_K`` times the K stride).
        BLOCK_K, DOT_PRECISION, UPCAST: the step, ``tl.dot``'s input precision, and whether to
            widen tiles to fp32 before the dot (bf16 under the interpreter).
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += step_x
        w_ptrs += step_w
    return acc


@triton.jit
def accumulate_k_desc(acc, x_ptrs, w_desc, w_row, row_ok, K, step_x,
                      BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """:func:`accumulate_k` with the weight tiles read through a tensor descriptor: acc += Σ over k < K
    of x[:, k] · W[w_row + n, k], in ``BLOCK_K`` steps; returns acc.

    Args:
        acc: [ROWS, COLS] fp32 accumulator.
        x_ptrs, row_ok, K, step_x: as in :func:`accumulate_k`.
        w_desc: a 2-D descriptor over the weight rows (output columns) × K, block [COLS, BLOCK_K],
            zero padding: columns past K and rows past the last read 0 (the hardware's bound, no mask).
        w_row: the descriptor row of the tile's first output column (int32).
        BLOCK_K, DOT_PRECISION, UPCAST: as in :func:`accumulate_k`.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = w_desc.load([w_row, k0])  # [COLS, BLOCK_K]: the weight's own (row-major) layout
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
        x_ptrs += step_x
    return acc


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """With ``PDL``, the kernel's first step (``moelora_kernels._common.pdl_options``): wait until the
    stream's previous grid has completed and its writes are visible (``griddepcontrol.wait``), then let
    the next grid launched with PDL start its own programs (``griddepcontrol.launch_dependents``: it
    takes effect once every program of this grid has issued it or exited, and that grid waits for this
    one in turn). Called before any load or store and before any early exit, so no program touches a
    producer's output early and no grid completes before its predecessor. Without ``PDL``, nothing (the
    interpreter never takes the branch: it has no inline PTX)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
