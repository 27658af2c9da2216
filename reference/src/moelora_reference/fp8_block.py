"""fp8 block-scaled w8a8 on the torch base path (DESIGN.md §1, "Quantized base"), in fp32.

    s[t, g]  = fp32(max(amax_{k∈g} |x[t, k]|, eps) / 448)                per token t, K-group g of bk
    q[t, k]  = RNE_e4m3(clamp(fp32(x[t, k] / s[t, g]), -448, 448))       an e4m3 value, held in fp32
    Ŵ[n, k]  = W_q[n, k] · scale_inv[row_block(n), k // bk]              (fp32)

The rounding to e4m3 is written out (exponent from ``frexp``, step 2^(e-3), subnormal step 2^-9,
``torch.round`` = half to even) rather than left to a dtype cast, so it means the same on every
machine: the Triton interpreter's fp32 → fp8 cast rounds ties away from zero, mishandles subnormals
and does not saturate (464 → NaN). Every step here is exact in fp32 except the division x / s
(IEEE, correctly rounded) and the scale's division, which the contract defines in fp32.

Source: vLLM ``per_token_group_quant_fp8`` (the scale and clamp), DeepSeek-V3 ``act_quant`` /
``weight_dequant`` (the format). The oracle's fp64 emulation (``moelora_reference.oracle``) is
written apart from this one.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.fp8_block import ACT_SCALE_EPS, FP8_E4M3_MAX, dequantize_weight, weight_row_blocks

F32 = torch.float32


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values already within ±448 to the nearest e4m3 value, ties to even (fp32 result).

    e4m3: 3 mantissa bits, normal exponents from -6, subnormals in steps of 2^-9.
    """
    a = v.abs()
    _, e = torch.frexp(a)  # a = m · 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    exp = torch.clamp(e - 1, min=-6)  # subnormals share the smallest normal exponent's step
    step = torch.ldexp(torch.ones_like(a), exp - 3)
    r = torch.round(a / step) * step
    return torch.where(v < 0, -r, r)  # as the kernel: a zero is +0.0


def quantize_activation(x: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-K-group fp8 quantization of x [T, K] (the last group may be partial).

    Returns:
        (q [T, K] fp32 holding e4m3 values, s [T, ⌈K/bk⌉] fp32 scales): x ≈ q · s of its group.
    """
    T, K = x.shape
    groups = math.ceil(K / block_k)
    xf = x.to(F32)
    pad = torch.zeros(T, groups * block_k, dtype=F32, device=x.device)
    pad[:, :K] = xf
    amax = pad.reshape(T, groups, block_k).abs().amax(dim=-1)  # [T, G]
    s = torch.clamp(amax, min=ACT_SCALE_EPS) / FP8_E4M3_MAX  # [T, G] fp32
    s_full = s.repeat_interleave(block_k, dim=1)[:, :K]
    q = round_to_e4m3(torch.clamp(xf / s_full, -FP8_E4M3_MAX, FP8_E4M3_MAX))
    return q, s


def dequantize_activation(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x̂ = q · s of :func:`quantize_activation`, in fp32 ([T, K]): what the base GEMM multiplies."""
    q, s = quantize_activation(x, block_k)
    return q * s.repeat_interleave(block_k, dim=1)[:, : x.shape[1]]


def dequantize_moe(base: MoEBaseWeights) -> MoEBaseWeights:
    """The same block with its fp8 experts dequantized to fp32 (Ŵ; no activation quantization): what
    transformers 5.17 computes on a CPU, where it dequantizes fp8 checkpoints at load (weights only).
    An unquantized block is returned as is."""
    if base.weight_block is None:
        return base
    return replace(base, w_gate_up=dequantize_weight(base.w_gate_up, base.w_gate_up_scale_inv, base.weight_block,
                                                     base.intermediate_size),
                   w_down=dequantize_weight(base.w_down, base.w_down_scale_inv, base.weight_block),
                   weight_block=None, w_gate_up_scale_inv=None, w_down_scale_inv=None)


def fp8_moe_gemm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, c: torch.Tensor,
                 align, *, block: tuple[int, int], top_k: int, num_pairs: int, in_row_div: int,
                 half: int | None = None, slot: int = 0, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of ``moelora_kernels.fp8_block.fp8_moe_gemm``, in float64 loops over the alignment's blocks:

        c[p, n] = w_p · Σ_g s[p', g] · scale_inv[e, rb(n), g] · Σ_{k∈g} q[p', k] · W_q[e, n, k]

    (p' = p // in_row_div), rounded once to c's dtype; blocks of expert -1 and padding rows are skipped.
    """
    bn, bk = block
    N, K = w.shape[1:]
    groups = math.ceil(K / bk)
    rows_scale = weight_row_blocks(N, bn, None if half is None or half == N else half, w.device)
    sorted_ids = align.sorted_token_ids[slot].tolist()
    expert_ids = align.expert_ids[slot].tolist()
    block_m = len(sorted_ids) // len(expert_ids)
    weights = None if topk_weights is None else topk_weights.reshape(-1).to(torch.float64)
    for b in range(int(align.num_tokens_post_padded[slot]) // block_m):
        e = expert_ids[b]
        rows = [p for p in sorted_ids[b * block_m:(b + 1) * block_m] if 0 <= p < num_pairs]
        if e < 0 or e >= w.shape[0] or not rows:
            continue
        p = torch.tensor(rows, device=c.device)
        x = q[p // in_row_div].to(torch.float64)  # [rows, K]
        sx = s[p // in_row_div].to(torch.float64)  # [rows, G]
        sw = scale_inv[e].to(torch.float64)[rows_scale]  # [N, G]
        v = torch.zeros(len(rows), N, dtype=torch.float64, device=c.device)
        for g in range(groups):
            k = slice(g * bk, (g + 1) * bk)
            v += (x[:, k] @ w[e, :, k].to(torch.float64).T) * sx[:, g:g + 1] * sw[:, g][None, :]
        if weights is not None:
            v = v * weights[p][:, None]
        c[p] = v.to(c.dtype)
    return c


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """A dense w8a8 projection (DESIGN.md §1): x̂ Ŵᵀ (+ b) with x [T, in] quantized per token per K-group
    and W_q [out, in] fp8 dequantized by ``scale_inv`` [⌈out/bn⌉, ⌈in/bk⌉], in fp32, rounded once to x's
    dtype. Graph-safe (no host reads). The LoRA delta of the projection reads the unquantized x."""
    y = dequantize_activation(x, block[1]) @ dequantize_weight(w_q, scale_inv, block).T
    if bias is not None:
        y = y + bias.to(F32)
    return y.to(x.dtype)
