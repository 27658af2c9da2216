"""fp8 block-scaled w8a8 for the base fused MoE (DESIGN.md §1, "Quantized base").

Two kernels, each with a twin in ``moelora_reference.fp8_block``:

- :func:`quantize_activation_fp8`: per row t and K-group g of bk (the last partial),
  ``s[t, g] = fp32(max(amax_g |x[t]|, eps) / 448)`` and ``q[t, k] = RNE_e4m3(clamp(x[t, k] / s[t, g], ±448))``,
  the rounding written out in the kernel (exponent from the bits, explicit ties-to-even), so kernel
  and twin agree bit for bit on a GPU and under the interpreter, whose fp32 → fp8 cast rounds ties
  away from zero, mishandles subnormals and does not saturate (464 → NaN).
- :func:`fp8_moe_gemm`: the grouped GEMM of :func:`.fused_moe.fused_moe_gemm` over the same
  alignment, one K step per group:

      C[p, n] = w_p · Σ_g (Σ_{k∈g} q[p // in_row_div, k] · W_q[e, n, k]) · s[p // in_row_div, g]
                                                                       · scale_inv[e, rb(n), g]

  with ``rb(n) = (n // half)·⌈half/bn⌉ + (n % half) // bn`` (a fused gate_up: gate's grid, then up's;
  ``half = N`` for one grid). Each group's partial sum is an fp32 dot of e4m3 values (every product
  exact); it is scaled by the two scales, in that order, and added to the fp32 accumulator; the
  router weight and one rounding to C's dtype end it.

Tensors: ``x`` [rows, K] fp32/fp16/bf16, last stride 1; ``q`` [rows, K] float8_e4m3fn on a GPU (the
tensor cores' fp8 dot) and fp32 under the interpreter (holding the same e4m3 values); ``s`` [rows,
⌈K/bk⌉] fp32; ``w`` [E_w, N, K] float8_e4m3fn; ``scale_inv`` [E_w, rows of the grid, ⌈K/bk⌉] fp32;
``c`` [num_pairs, N]; the alignment as :func:`.fused_moe.fused_moe_gemm` takes it. bk is any positive
block (DeepSeek-V3's 128; the tiny fixtures' 4, 8, 16): each ``tl.dot`` step covers one group, padded
with masked zeros to :func:`k_tile` (a power of two, at least the 16 a dot needs). Offsets of rows,
experts and columns are 64-bit. Source: vLLM ``per_token_group_quant_fp8`` and
``fused_moe_kernel`` (block-quantized path), DeepSeek-V3 ``act_quant`` / ``fp8_gemm``.
"""

from __future__ import annotations

import math

import torch
import triton

from moelora_core.align import AlignOutput
from moelora_core.errors import KernelPreconditionError
from moelora_core.fp8_block import ACT_SCALE_EPS, FP8_DTYPE
from moelora_kernels._common import (
    FLOAT_DTYPES,
    check_align_pairs,
    check_grid,
    check_positive_int,
    check_tensor,
    dot_precision,
    interpreting,
    next_pow2,
    pdl_options,
)
from moelora_kernels._fp8_block_kernels import _fp8_moe_gemm_kernel, _quant_fp8_groups_kernel
from moelora_kernels.configs import kernel_config
from moelora_kernels.fused_moe import check_pairs_and_align, used_blocks_bound


def _check_group(block_k: int) -> int:
    check_positive_int("block_k", block_k)
    return block_k


def k_tile(block_k: int) -> int:
    """The GEMM's K step for a K-group of ``block_k``: the group padded to a power of two and to the
    16 a ``tl.dot`` needs (the masked columns are zeros, so each step still sums exactly one group)."""
    return max(16, next_pow2(block_k))


def q_dtype(device: torch.device) -> torch.dtype:
    """Storage of the quantized activations: fp8 on a GPU, fp32 under the interpreter (same values)."""
    return torch.float32 if interpreting() or device.type != "cuda" else FP8_DTYPE


def quantize_activation_fp8(x: torch.Tensor, block_k: int, *, config: dict | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, K], s [rows, ⌈K/bk⌉] fp32) of x [rows, K] (module docstring).

    One program per (``QUANT_ROWS`` rows, K-group): the table's ``quantize_activation_fp8`` entry (1 where
    none: one program per row and group); ``config`` overrides it. Every value gives the same bits.

    Raises:
        KernelPreconditionError: x not a 2-D float tensor with last stride 1; bk not a positive int;
            ``QUANT_ROWS`` not a power of two; ``PDL`` not 0 / 1, or 1 below sm_90.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    _check_group(block_k)
    rows, K = x.shape
    groups = math.ceil(K / block_k)
    cfg = kernel_config("quantize_activation_fp8", rows=rows, K=K, overrides=config)
    per = cfg["QUANT_ROWS"]
    if type(per) is not int or per < 1 or per & (per - 1):
        raise KernelPreconditionError(f"QUANT_ROWS: must be a power of two >= 1, got {per!r}")
    pdl = pdl_options(cfg, x.device)
    q = torch.empty(rows, K, dtype=q_dtype(x.device), device=x.device)
    s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows == 0 or K == 0:
        return q, s
    grid = check_grid("quantize_activation_fp8", (triton.cdiv(rows, per), groups))
    _quant_fp8_groups_kernel[grid](x, q, s, rows, K, ACT_SCALE_EPS, x.stride(0), q.stride(0), s.stride(0),
                                   GROUP=block_k, BLOCK=next_pow2(block_k), QUANT_ROWS=per, **pdl)
    return q, s


def fp8_moe_gemm(
    q: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    c: torch.Tensor,
    align: AlignOutput,
    *,
    block: tuple[int, int],
    top_k: int,
    num_pairs: int,
    in_row_div: int,
    half: int | None = None,
    slot: int = 0,
    topk_weights: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """C[p] = w_p · Σ_g s[p', g] · scale_inv[e, rb(n), g] · (q[p', g] · W_q[e, :, g]ᵀ) for every aligned pair p
    (p' = p // in_row_div; module docstring).

    Args:
        q, s: :func:`quantize_activation_fp8` of the GEMM's input ([rows_in, K], [rows_in, G]).
        w: [E_w, N, K] float8_e4m3fn. scale_inv: [E_w, grid rows, G] fp32.
        c: [num_pairs, N] output (any float dtype), written at aligned pairs only.
        align, top_k, num_pairs, in_row_div, slot, topk_weights: as :func:`.fused_moe.fused_moe_gemm`.
        block: (bn, bk) of the weights. half: rows per scale grid (I for a fused gate_up), None = N.

    Raises:
        KernelPreconditionError: dtypes, shapes, devices; a scale grid of another shape; bk not a positive
            int; an alignment for more experts than ``w`` or another pair count; ``PDL`` (the config key
            of :func:`moelora_kernels._common.pdl_options`) not 0 / 1, or 1 below sm_90.
    """
    bn, bk = block
    _check_group(bk)
    check_positive_int("block_n", bn)
    check_tensor("q", q, dtypes=(torch.float32, FP8_DTYPE), dim=2, unit_last_stride=True)
    device = q.device
    check_tensor("w", w, dtypes=(FP8_DTYPE,), dim=3, device=device)
    E_w, N, K = w.shape
    if q.shape[1] != K:
        raise KernelPreconditionError(f"q: {q.shape[1]} columns, but w's reduction size K is {K}")
    G = math.ceil(K / bk)
    check_tensor("s", s, dtypes=(torch.float32,), shape=(q.shape[0], G), device=device)
    half = N if half is None else half
    check_positive_int("half", half)
    if N % half:
        raise KernelPreconditionError(f"half: {half} does not divide N={N}")
    half_blocks = math.ceil(half / bn)
    check_tensor("scale_inv", scale_inv, dtypes=(torch.float32,), shape=(E_w, (N // half) * half_blocks, G),
                 device=device)
    check_tensor("c", c, dtypes=FLOAT_DTYPES, shape=(num_pairs, N), device=device)
    check_pairs_and_align("q", q.shape[0], top_k=top_k, num_pairs=num_pairs, in_row_div=in_row_div, align=align,
                          slot=slot, device=device)
    P, num_blocks = align.sorted_token_ids.shape[1], align.expert_ids.shape[1]
    if num_blocks == 0 or P % num_blocks:
        raise KernelPreconditionError(f"align: {P} rows do not split into {num_blocks} blocks")
    block_m = P // num_blocks
    check_align_pairs(align, num_pairs)
    if align.num_experts is not None and align.num_experts > E_w:
        raise KernelPreconditionError(f"align: made for {align.num_experts} experts, but w holds {E_w}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32, *FLOAT_DTYPES), contiguous=True,
                     device=device)
        if topk_weights.numel() != num_pairs:
            raise KernelPreconditionError(f"topk_weights: {topk_weights.numel()} elements for {num_pairs} pairs")
    # its own measured tiles (``fp8_moe_gemm``) where the table has them, else the bf16 GEMM's (``PDL``
    # included); checked before the empty-batch return, so a bad value is refused at any batch size
    cfg = kernel_config("fp8_moe_gemm", rows=num_pairs, N=N, K=K, overrides=config, fallback_op="fused_moe_gemm")
    pdl = pdl_options(cfg, device)
    if num_pairs == 0:
        return c
    grid = check_grid("fp8_moe_gemm", (used_blocks_bound(num_pairs, E_w, block_m, num_blocks),
                                       triton.cdiv(N, cfg["BLOCK_N"])))
    dummy = align.num_tokens_post_padded
    _fp8_moe_gemm_kernel[grid](
        q, s, w, scale_inv, c,
        align.sorted_token_ids[slot], align.expert_ids[slot], align.num_tokens_post_padded[slot:slot + 1],
        topk_weights if topk_weights is not None else dummy,
        N, K, num_pairs, in_row_div, E_w, half, half_blocks, bn,
        q.stride(0), q.stride(1), s.stride(0), w.stride(0), w.stride(1), w.stride(2),
        scale_inv.stride(0), scale_inv.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], GROUP=bk, K_TILE=k_tile(bk),
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        # the tensor cores' fp8 dot takes K steps of 32 and more; below, e4m3 tiles are widened (exactly)
        FP8_DOT=q.dtype == FP8_DTYPE and k_tile(bk) >= 32, DOT_PRECISION=dot_precision(torch.float32), **pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return c
