"""Virtual experts: the MoE-LoRA delta as a base fused MoE over max_loras·E experts.

Each (slot, expert) pair becomes expert ``slot·E + expert`` of a virtual MoE with L·E experts, so
the base kernels do the work unchanged (:func:`moelora_kernels.fused_moe.fused_moe_gemm`):

1. :func:`virtual_topk_ids` maps every (token, k) pair to its virtual expert, and every pair that
   must get no LoRA to -1: a token with NO_ADAPTER, an id < 0 (EXPERT_NOT_HERE), an id >= E (an
   extra fused base expert). A sentinel never becomes a real id (it is never remapped onto another
   adapter's expert).
2. the base alignment (:func:`moelora_kernels.align.moe_align_block_size`) groups pairs over L·E
   experts; -1 pairs are in no block.
3. shrink: the grouped GEMM with LoRA A viewed as [L·E, R, in] "expert weights" (a view of the
   [L, E, R, in] buffer, no copy) writes the rank-wide intermediate; expand: the grouped GEMM with
   B viewed as [L·E, out, R] adds ``σ[slot] · w_p · B t`` into the output (σ per slot through the
   GEMM's per-expert scale, ``scale[v // E]``; w_p for "down").

Tensors: ``topk_ids`` [M, top_k] int32/int64, ``token_lora_mapping`` [M] int32, virtual ids
[M, top_k] int32 (out). Rank: the whole pool rank R is used (zero padding makes it exact); the
per-slot rank bound of :mod:`.moe_lora` is the faster path. Rounding as the base GEMM (fp32
accumulation, the intermediate rounded to the activation dtype, one rounding of the sum).
Source: the virtual-experts formulation of MoE-LoRA in SGLang (sgl-project/sglang#14105).
"""

from __future__ import annotations

import torch
import triton

from moelora_core.align import AlignOutput
from moelora_core.errors import KernelPreconditionError
from moelora_core.weights import LoRAWeights
from moelora_kernels._common import INDEX_DTYPES, check_grid, check_positive_int, check_tensor
from moelora_kernels._virtual_experts_kernels import _virtual_topk_ids_kernel
from moelora_kernels.align import moe_align_block_size
from moelora_kernels.configs import moe_block_m
from moelora_kernels.fused_moe import fused_moe_gemm
from moelora_kernels.moe_lora import STAGES, stage_tensors


def virtual_topk_ids(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    *,
    max_loras: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """v[t, j] = slot(t)·E + topk_ids[t, j] where the pair gets LoRA, else -1.

    Args:
        topk_ids: [M, top_k] int32/int64, contiguous.
        token_lora_mapping: [M] int32 slot per token (-1 = none).
        num_experts: E (ids >= E are extra base experts: no LoRA, so -1).
        max_loras: when given, slots >= it are treated as none (defensive bound).
        out: [M, top_k] int32 (allocated when None).

    Returns:
        The virtual ids [M, top_k] int32.

    Raises:
        KernelPreconditionError: dtype, shape, device or contiguity errors; L·E >= 2^31.
    """
    check_positive_int("num_experts", num_experts)
    if max_loras is not None:
        check_positive_int("max_loras", max_loras)
        if max_loras * num_experts >= 1 << 31:
            raise KernelPreconditionError(f"max_loras: {max_loras} slots × {num_experts} experts overflow int32 ids")
    bound = max_loras if max_loras is not None else (2**31 - 1) // num_experts
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dim=2, contiguous=True)
    device = topk_ids.device
    M, top_k = topk_ids.shape
    check_tensor("token_lora_mapping", token_lora_mapping, dtypes=(torch.int32,), shape=(M,), contiguous=True,
                 device=device)
    if out is None:
        out = torch.empty(M, top_k, dtype=torch.int32, device=device)
    check_tensor("out", out, dtypes=(torch.int32,), shape=(M, top_k), contiguous=True, device=device)
    if M == 0:
        return out
    block = 1024
    grid = check_grid("virtual_topk_ids", (triton.cdiv(M * top_k, block),))
    _virtual_topk_ids_kernel[grid](topk_ids, token_lora_mapping, out, M * top_k, top_k, num_experts, bound,
                                   BLOCK=block)
    return out


def virtual_align(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    max_loras: int,
    *,
    block_m: int | None = None,
    out: AlignOutput | None = None,
) -> tuple[torch.Tensor, AlignOutput]:
    """Virtual ids and their base alignment over ``max_loras · E`` experts (once per layer).

    Returns:
        (virtual ids [M, top_k] int32, ``AlignOutput`` with one slot row).
    """
    M, top_k = topk_ids.shape
    vids = virtual_topk_ids(topk_ids, token_lora_mapping, num_experts, max_loras=max_loras)
    if block_m is None:
        block_m = moe_block_m(M, top_k, num_experts * max_loras)
    return vids, moe_align_block_size(vids, num_experts * max_loras, block_m, out=out)


def virtual_moe_lora_delta(
    stage: str,
    x: torch.Tensor,
    out: torch.Tensor,
    weights: LoRAWeights,
    align: AlignOutput,
    *,
    top_k: int,
    topk_weights: torch.Tensor | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Add the MoE-LoRA delta of ``stage`` through virtual experts (reusing the base GEMM kernel).

    Args:
        stage: "gate_up" (x [M, H], out [M, top_k, 2I]) or "down" (x = h [M·top_k, I], out
            [M, top_k, H], topk_weights [M, top_k]).
            ``out`` in x's dtype or fp32.
        weights: the pool; its [L, E, ...] buffers are viewed as [L·E, ...] (a factor stored once
            per slot is read as [L, ...] by every expert of its slot: expert stride 0).
        align: :func:`virtual_align`'s alignment.

    Returns:
        ``out``.

    Raises:
        KernelPreconditionError: unknown stage, missing / extra router weights, shape errors.
    """
    if stage not in STAGES:
        raise KernelPreconditionError(f"stage: {stage!r} not in {STAGES}")
    t = stage_tensors(weights, stage)
    L, E = weights.spec.max_loras, weights.spec.E
    A = t["lora_a"] if stage == "gate_up" else t["lora_a"].unsqueeze(0)
    B = t["lora_b"] if stage == "gate_up" else t["lora_b"].unsqueeze(0)
    scalings = t["scalings"] if stage == "gate_up" else t["scalings"].unsqueeze(0)
    S, R, N = A.shape[0], A.shape[3], B.shape[3]
    num_pairs = x.shape[0] * top_k if stage == "gate_up" else x.shape[0]
    in_row_div = top_k if stage == "gate_up" else 1
    if stage == "down" and topk_weights is None:
        raise KernelPreconditionError("topk_weights: stage 'down' is router-weighted; pass [M, top_k] weights")
    if stage == "gate_up" and topk_weights is not None:
        raise KernelPreconditionError("topk_weights: stage 'gate_up' is not router-weighted")
    check_tensor("out", out, dtypes=(x.dtype, torch.float32), unit_last_stride=True, device=x.device)
    if out.numel() != num_pairs * S * N:
        raise KernelPreconditionError(f"out: {list(out.shape)} is not [M, top_k, {S * N}] for {num_pairs} pairs")
    try:
        out2 = out.view(num_pairs, S * N)
    except RuntimeError:
        raise KernelPreconditionError(f"out: strides {out.stride()} do not merge into [M*top_k, {S * N}]") from None
    inter = torch.empty(S, num_pairs, R, dtype=x.dtype, device=x.device)
    for s in range(S):
        a, a_per = _virtual_weight(A[s], L, E)
        b, b_per = _virtual_weight(B[s], L, E)
        fused_moe_gemm(x, a, inter[s], align, top_k=top_k, num_pairs=num_pairs, in_row_div=in_row_div,
                       experts_per_weight=a_per, tf32=tf32)
        fused_moe_gemm(inter[s], b, out2[:, s * N:(s + 1) * N], align, top_k=top_k,
                       num_pairs=num_pairs, in_row_div=1, topk_weights=topk_weights, scale=scalings[s],
                       experts_per_scale=E, experts_per_weight=b_per, add_into=True, tf32=tf32)
    return out


def _virtual_weight(w: torch.Tensor, L: int, E: int) -> tuple[torch.Tensor, int]:
    """One slice's [L, E, n, k] factor as the GEMM's expert weights: the [L·E, n, k] view of a
    per-expert buffer (experts_per_weight 1), or, for a factor stored once per slot (expert stride
    0), its [L, n, k] storage read by all E virtual experts of a slot (experts_per_weight E). Never
    a copy: flattening a stride-0 view would materialise the factor E times."""
    if E > 1 and w.stride(1) == 0:
        return w[:, 0], E
    return w.view(L * E, *w.shape[2:]), 1
