"""Launchers of the dense LoRA kernels (:mod:`._sgmv_kernels`): segmented LoRA-A/B and chunked SGMV.

- :func:`segmented_lora_a` / :func:`segmented_lora_b`: the intermediate is indexed by token row
  (``triton`` backend; ``permutation`` optional: DECODE sorts requests by adapter).
- :func:`chunked_sgmv_shrink` / :func:`chunked_sgmv_expand`: the intermediate is indexed by sorted
  position (``csgmv`` backend; ``permutation`` required).
- :func:`dense_lora_delta`: both steps for one module from a ``LoRAWeights`` and a
  ``LoRABatchInfo`` (``seg_indptr``, ``weight_indices``, ``permutation``, ``max_len``).

Grids are ``(S, cdiv(max_len, BLOCK_S)[, cdiv(out, BLOCK_N)])`` from host numbers only; the device
segment bounds decide which programs work. No launcher reads a device value; the kernels check the
device metadata against the host T and L instead (range contract in :mod:`._sgmv_kernels`: slots
outside [0, L) and rows outside [0, T) add nothing and are never dereferenced).
"""

from __future__ import annotations

import torch
import triton

from moelora_core.batch_info import LoRABatchInfo
from moelora_core.errors import KernelPreconditionError
from moelora_core.weights import LoRAWeights
from moelora_kernels._common import (
    FLOAT_DTYPES,
    check_grid,
    check_positive_int,
    check_rank_bound,
    check_rank_covers,
    check_tensor,
    gemm_launch_options,
    next_pow2,
)
from moelora_kernels._sgmv_kernels import _dense_lora_expand_kernel, _dense_lora_shrink_kernel
from moelora_kernels.configs import kernel_config


def _segments(seg_indptr, weight_indices, permutation, num_tokens, max_len, device, need_permutation):
    check_tensor("weight_indices", weight_indices, dtypes=(torch.int32,), dim=1, contiguous=True, device=device)
    S = weight_indices.shape[0]
    check_tensor("seg_indptr", seg_indptr, dtypes=(torch.int32,), shape=(S + 1,), contiguous=True, device=device)
    if permutation is None and need_permutation:
        raise KernelPreconditionError("permutation: chunked SGMV reads tokens in adapter-sorted order; pass the "
                                      "[T] int64 permutation")
    if permutation is not None:
        check_tensor("permutation", permutation, dtypes=(torch.int64,), shape=(num_tokens,), contiguous=True,
                     device=device)
    check_positive_int("max_len", max_len, minimum=0)
    return S


def _shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, max_len, out, max_rank, tf32, config,
            inter_sorted, name):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    device, dtype = x.device, x.dtype
    check_tensor("lora_a", lora_a, dtypes=(dtype,), dim=3, unit_last_stride=True, device=device)
    L, R, K = lora_a.shape
    if x.shape[1] != K:
        raise KernelPreconditionError(f"x: {x.shape[1]} columns, but lora_a's input width is {K}")
    check_tensor("ranks", ranks, dtypes=(torch.int32,), shape=(L,), unit_last_stride=True, device=device)
    T = x.shape[0]
    S = _segments(seg_indptr, weight_indices, permutation, T, max_len, device, inter_sorted)
    bound = check_rank_bound(max_rank, R)
    if out is None:
        out = torch.empty(T, R, dtype=dtype, device=device)
    check_tensor("out", out, dtypes=(dtype,), shape=(T, R), unit_last_stride=True, device=device)
    if S == 0 or max_len == 0 or T == 0:
        return out
    cfg = kernel_config("dense_lora_shrink", rows=T, K=K, R=bound, overrides=config)
    grid = check_grid(name, (S, triton.cdiv(max_len, cfg["BLOCK_S"])))
    _dense_lora_shrink_kernel[grid](
        x, lora_a, out, seg_indptr, weight_indices, ranks, permutation if permutation is not None else seg_indptr,
        K, R, bound, T, L,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        BLOCK_S=cfg["BLOCK_S"], BLOCK_R=next_pow2(bound, 16), BLOCK_K=cfg["BLOCK_K"],
        HAS_PERMUTATION=permutation is not None, INTER_SORTED=inter_sorted, **gemm_launch_options(dtype, tf32, cfg),
    )
    return out


def _expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, max_len, max_rank,
            tf32, config, inter_sorted, name):
    check_tensor("intermediate", intermediate, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    device, dtype = intermediate.device, intermediate.dtype
    check_tensor("lora_b", lora_b, dtypes=(dtype,), dim=3, unit_last_stride=True, device=device)
    L, N, R = lora_b.shape
    T = intermediate.shape[0]
    check_tensor("intermediate", intermediate, shape=(T, R))
    check_tensor("ranks", ranks, dtypes=(torch.int32,), shape=(L,), unit_last_stride=True, device=device)
    check_tensor("scalings", scalings, dtypes=(torch.float32,), shape=(L,), unit_last_stride=True, device=device)
    # out in the intermediate's dtype or fp32: the epilogue adds in fp32 and rounds once to out's dtype.
    check_tensor("out", out, dtypes=(dtype, torch.float32), shape=(T, N), unit_last_stride=True, device=device)
    S = _segments(seg_indptr, weight_indices, permutation, T, max_len, device, inter_sorted)
    bound = check_rank_bound(max_rank, R)
    if S == 0 or max_len == 0 or T == 0:
        return out
    cfg = kernel_config("dense_lora_expand", rows=T, N=N, R=bound, overrides=config)
    grid = check_grid(name, (S, triton.cdiv(max_len, cfg["BLOCK_S"]), triton.cdiv(N, cfg["BLOCK_N"])))
    _dense_lora_expand_kernel[grid](
        intermediate, lora_b, out, seg_indptr, weight_indices, ranks, scalings,
        permutation if permutation is not None else seg_indptr,
        N, bound, T, L,
        intermediate.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_S=cfg["BLOCK_S"], BLOCK_R=next_pow2(bound, 16), BLOCK_N=cfg["BLOCK_N"],
        HAS_PERMUTATION=permutation is not None, INTER_SORTED=inter_sorted, **gemm_launch_options(dtype, tf32, cfg),
    )
    return out


def segmented_lora_a(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    ranks: torch.Tensor,
    *,
    max_len: int,
    permutation: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_rank: int | None = None,
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """t[row] = A[slot] @ x[row] for the rows of every segment with a slot (row order).

    Args:
        x: [T, in]; lora_a: [L, R, in]; seg_indptr: [S + 1] int32; weight_indices: [S] int32;
        ranks: [L] int32 module ranks; max_len: host bound on segment length; permutation: [T]
        int64 or None (position → token row); out: [T, R] (allocated when None; rows outside
        adapter segments are not written); max_rank: host rank bound (<= R).

    Returns:
        The intermediate [T, R].

    Raises:
        KernelPreconditionError: dtype, shape, stride, device errors; max_rank > R.
    """
    return _shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, max_len, out, max_rank, tf32, config,
                   False, "segmented_lora_a")


def segmented_lora_b(
    intermediate: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    *,
    max_len: int,
    permutation: torch.Tensor | None = None,
    max_rank: int | None = None,
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """out[row] += σ[slot] · B[slot] @ t[row] for the rows of every segment with a slot.

    Args:
        intermediate: [T, R] from :func:`segmented_lora_a`; lora_b: [L, out, R]; scalings: [L] fp32;
        out: [T, out] added into in place (the intermediate's dtype or fp32); others as
        :func:`segmented_lora_a`.

    Returns:
        ``out``.

    Raises:
        KernelPreconditionError: dtype, shape, stride, device errors; max_rank > R.
    """
    return _expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, max_len,
                   max_rank, tf32, config, False, "segmented_lora_b")


def chunked_sgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    ranks: torch.Tensor,
    permutation: torch.Tensor,
    *,
    max_len: int,
    out: torch.Tensor | None = None,
    max_rank: int | None = None,
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """t[i] = A[slot] @ x[permutation[i]] for the sorted positions i of every chunk with a slot.

    Args: as :func:`segmented_lora_a`, with ``permutation`` required and the intermediate [T, R]
    indexed by sorted position.

    Returns:
        The intermediate [T, R] (sorted order).
    """
    return _shrink(x, lora_a, seg_indptr, weight_indices, ranks, permutation, max_len, out, max_rank, tf32, config,
                   True, "chunked_sgmv_shrink")


def chunked_sgmv_expand(
    intermediate: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    weight_indices: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    permutation: torch.Tensor,
    out: torch.Tensor,
    *,
    max_len: int,
    max_rank: int | None = None,
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """out[permutation[i]] += σ[slot] · B[slot] @ t[i] for the sorted positions of every chunk with a slot.

    Returns:
        ``out``.
    """
    return _expand(intermediate, lora_b, seg_indptr, weight_indices, ranks, scalings, permutation, out, max_len,
                   max_rank, tf32, config, True, "chunked_sgmv_expand")


def dense_lora_delta(
    module: str,
    x: torch.Tensor,
    out: torch.Tensor,
    weights: LoRAWeights,
    info: LoRABatchInfo,
    *,
    chunked: bool = False,
    max_rank: int | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """out += σ · B (A x) of dense ``module`` for every token with an adapter, from a batch info.

    ``info.seg_indptr`` / ``weight_indices`` / ``permutation`` / ``max_len`` feed the kernels;
    the module's own ranks and σ come from ``weights`` (they bound the rank loop per slot).
    ``chunked=True`` runs the chunked SGMV pair (needs ``info.permutation``). ``max_rank`` must
    cover every loaded slot's rank of ``module`` (``weights.host_ranks``); None = the pool's R.

    Returns:
        ``out``.

    Raises:
        KernelPreconditionError: as the launchers; ``max_rank`` below a loaded slot's rank of
            ``module``.
    """
    A, B = weights.factors(module)
    check_rank_covers(max_rank, weights, (module,))
    ranks, scalings = weights.ranks(module), weights.scalings(module)
    common = {"max_len": info.max_len, "max_rank": max_rank, "tf32": tf32}
    if chunked:
        t = chunked_sgmv_shrink(x, A, info.seg_indptr, info.weight_indices, ranks, info.permutation, **common)
        return chunked_sgmv_expand(t, B, info.seg_indptr, info.weight_indices, ranks, scalings, info.permutation,
                                   out, **common)
    t = segmented_lora_a(x, A, info.seg_indptr, info.weight_indices, ranks, permutation=info.permutation, **common)
    return segmented_lora_b(t, B, info.seg_indptr, info.weight_indices, ranks, scalings, out,
                            permutation=info.permutation, **common)
