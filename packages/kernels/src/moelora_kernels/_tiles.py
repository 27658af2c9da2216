"""Triton helpers shared by the kernel files (``@triton.jit`` functions called from kernels).

Triton inlines a jit function into the kernel that calls it, so a helper costs nothing at run time:
the kernels compile to the same code as with the body written in place. Each helper here is a step
that several kernels take the same way.

- :func:`accumulate_k`: the fp32 reduction over K of a gathered row tile and a weight tile, in
  ``BLOCK_K`` steps (base grouped GEMM and its fused LoRA shrink, MoE-LoRA shrink, fused MoE-LoRA,
  dense LoRA shrink).
- :func:`add_lora_expand`: the MoE-LoRA expand in a base GEMM's epilogue (``moelora_core.gemm_lora``).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def add_lora_expand(acc, pairs64, row_ok, offs_n, n_ok, n_first, expert,
                    t_ptr, b_ptr, scal_ptr, rank_ptr, mapping_ptr, enabled_ptr,
                    L, Ns, lora_E, top_k, rank_bound, stride_ts, stride_tp, stride_bs, stride_bl, stride_be,
                    stride_bn, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, S: tl.constexpr,
                    HAS_ENABLED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + Σ_l (σ[s, l] · t[s, p])·B[s, l, e]ᵀ on each row p of slot l, into acc itself
    (``moelora_core.gemm_lora``: the expand in a base GEMM's epilogue); returns acc.

    Args:
        acc: [BLOCK_M, BLOCK_N] fp32 base tile of expert ``expert`` (int64 scalar).
        pairs64: [BLOCK_M] int64 pair of each row; row_ok: rows that hold a pair.
        offs_n, n_ok: the tile's columns and which are < N; n_first: its first column.
        t_ptr [S, pairs, R], b_ptr [S, L, E_lora, Ns, R] (unit last strides), scal_ptr [S, L] fp32,
        rank_ptr [S, L] int32 (both contiguous), mapping_ptr [M] int32, enabled_ptr [L] int32.
        L, Ns, lora_E, top_k: slots (<= BLOCK_L), columns per slice, experts with LoRA, experts per token.
        rank_bound: the host's bound on every rank (<= R, <= BLOCK_R): a device rank above it is read
            as it (a corrupt rank never reads past R, as in the separate kernels).

    One dot per (slice, slot), unrolled over ``BLOCK_L`` slots with no branch on the data and no second
    output tile: each accumulates into acc, its t tile holding only the slot's rows (masked zeros
    elsewhere), scaled by σ in fp32 and rounded once to t's dtype. Every other row adds exactly +0.0
    (the base accumulator is never -0.0), so rows without a delta keep the base bit for bit, given
    finite factors (the adapter reader refuses NaN and Inf: 0 · Inf would reach the block's other rows).
    """
    # experts in [E_lora, E_base) have no LoRA: their rows keep the base
    row_slot = tl.load(mapping_ptr + pairs64 // top_k, mask=row_ok & (expert < lora_E), other=-1)
    offs_r = tl.arange(0, BLOCK_R)
    for s in tl.static_range(S):
        lo = s * Ns
        if (n_first < lo + Ns) & (n_first + BLOCK_N > lo):  # the tile meets slice s
            col_s = n_ok & (offs_n >= lo) & (offs_n < lo + Ns)
            cols = (offs_n - lo).to(tl.int64)
            for slot in tl.static_range(BLOCK_L):
                live = (slot < L) & (expert < lora_E)  # no B to read past the slots or for a base-only expert
                rank = tl.minimum(tl.load(rank_ptr + s * L + slot, mask=live, other=0), rank_bound)
                sigma = tl.load(scal_ptr + s * L + slot, mask=live, other=0.0)
                if HAS_ENABLED:
                    rank = tl.where(tl.load(enabled_ptr + slot, mask=live, other=0) != 0, rank, 0)
                r_ok = offs_r < rank
                mine = row_ok & (row_slot == slot)
                t = tl.load(t_ptr + s * stride_ts + pairs64[:, None] * stride_tp + offs_r[None, :],
                            mask=mine[:, None] & r_ok[None, :], other=0.0)
                b = tl.load(b_ptr + s * stride_bs + slot * stride_bl + expert * stride_be
                            + cols[None, :] * stride_bn + offs_r[:, None],
                            mask=r_ok[:, None] & col_s[None, :], other=0.0)
                t = (t.to(tl.float32) * sigma).to(b.dtype)
                if UPCAST:
                    t = t.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(t, b, acc, input_precision=DOT_PRECISION)
    return acc
