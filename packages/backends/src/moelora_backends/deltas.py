"""The LoRA deltas of the kernel backends on ``moelora_kernels``: MoE (per request, always) and dense
(over the backend's segmentation).

MoE (:class:`MoEDeltas`): the token mapping of the batch info (written from the per-request fields)
→ ``moe_lora_align_block_size`` (per slot, pairs grouped by expert) → ``moe_lora_delta`` of the stage
("gate_up" before the activation, "down" router-weighted), σ and ranks read on the device at run
time. With ``spec.virtual_experts``: ``virtual_align`` over ``max_loras · E`` experts and
``virtual_moe_lora_delta`` (the base grouped GEMM on the ``[L·E, ...]`` views).

Alignment: the caller may align once per layer forward (``KernelBackend.moe_align``) and pass it to
both stages (``align=``; ``moelora_core.moe_deltas.BackendMoEDeltas`` does). Without it, each stage
call aligns its own ``topk_ids`` (one small launch, grid ``(max_loras,)``). The backend itself keeps
nothing between delta calls: a hand-off keyed by the ``topk_ids`` object cannot be made safe
without reading the device (an engine rewrites one routing buffer per layer in place; a Triton
store bumps no version counter; a layer whose pool lacks a stage skips that stage, so a cached
alignment outlived its layer: ``test_each_stage_aligns_its_own_call``). The per-layer object
of the caller has no such problem: it dies with the layer forward.

Dense (:func:`dense_delta`): segmented LoRA-A/B (``triton``: intermediate by token row) or chunked
SGMV (``csgmv``: by sorted position) over ``seg_indptr[:S + 1]`` / ``weight_indices[:S]`` with
``S = info.num_segments`` and ``max_len = info.max_len`` (capacities in graph mode).

Dtypes. Kernels compute in the pool's dtype (``spec.dtype``): activations of another dtype are cast
to it (the conformance harness keeps MoE intermediates in fp32: h is rounded once to the pool's
dtype, as an engine stores it). Outputs in the pool's dtype (the engine) or in fp32 (the harness)
are added into directly by the kernels' fp32 epilogue, so the delta is rounded once, to the
output's dtype. Any other output dtype gets the delta through a zeroed scratch in the pool's dtype,
merged with ``torch.where`` on the rows of tokens with an adapter, so rows without one are never
touched (bit-identical).

Rank bound: eagerly, the largest rank of the module in the pool's host ranks (tiles sized for it;
nothing is launched when no slot has the module); in graph mode the pool's R, because a captured
launch must stay right after a larger adapter is loaded.

No host sync: only host shapes, host ranks and the info's host fields steer Python.
"""

from __future__ import annotations

import torch
import triton

from moelora_core.align import AlignOutput
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights
from moelora_kernels import (
    chunked_sgmv_expand,
    chunked_sgmv_shrink,
    kernel_config,
    moe_block_m,
    moe_lora_align_block_size,
    moe_lora_delta,
    segmented_lora_a,
    segmented_lora_b,
    virtual_align,
    virtual_moe_lora_delta,
)

#: LoRAWeights modules of each MoE stage.
STAGE_MODULES = {"gate_up": ("gate", "up"), "down": ("down",)}


def rank_bound(weights: LoRAWeights, modules: tuple[str, ...], info: LoRABatchInfo) -> int | None:
    """The host rank bound the kernels tile for: None (the pool's R) in graph mode, else the largest
    host rank of ``modules`` in the pool (0 = no slot has them: nothing to add)."""
    if info.use_cuda_graph:
        return None
    return max(max(weights.host_ranks[m]) for m in modules)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


class _Target:
    """Where a kernel adds: ``out`` itself when it has the pool's dtype or fp32 (the kernels' epilogue
    adds in fp32 and rounds once to out's dtype), else a zeroed scratch in the pool's dtype that
    :meth:`merge` adds into ``out`` on the rows of tokens with an adapter."""

    def __init__(self, out: torch.Tensor, dtype: torch.dtype) -> None:
        self.out = out
        self.direct = out.dtype in (dtype, torch.float32) and out.is_contiguous()
        self.tensor = out if self.direct else torch.zeros(out.shape, dtype=dtype, device=out.device)

    def merge(self, token_lora_mapping: torch.Tensor) -> None:
        if self.direct:
            return
        out = self.out
        rows = (token_lora_mapping >= 0).view(-1, *([1] * (out.dim() - 1)))
        out.copy_(torch.where(rows, out + self.tensor, out))


def _segment_tile(op: str, rows: int, max_len: int, **shape: int) -> dict[str, int]:
    """The config table's tile for ``op``, its BLOCK_S cut to the segment bound (a power of two >= 16):
    16-token tiles and short decode segments then run half-empty tiles no more."""
    block_s = kernel_config(op, rows=rows, **shape)["BLOCK_S"]
    return {"BLOCK_S": min(block_s, max(16, triton.next_power_of_2(max(1, max_len))))}


def dense_delta(module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, *,
                chunked: bool) -> None:
    """out += σ · B (A x) of dense ``module`` for every token with an adapter (module docstring).

    Args:
        x: [T, in]; out: [T, out]; T = the info's token count (capacity in graph mode).
        chunked: chunked SGMV (the info's segments are adapter-sorted chunks with a permutation).
    """
    bound = rank_bound(weights, (module,), info)
    if bound == 0:
        return
    dtype = weights.spec.dtype
    S = info.num_segments
    seg_indptr, weight_indices = info.seg_indptr[: S + 1], info.weight_indices[:S]
    A, B = weights.factors(module)
    ranks, scalings = weights.ranks(module), weights.scalings(module)
    xk = _in_dtype(x, dtype)
    target = _Target(out, dtype)
    T, R = x.shape[0], A.shape[1]
    common = {"max_len": info.max_len, "max_rank": bound}
    shrink = {**common, "config": _segment_tile("dense_lora_shrink", T, info.max_len, K=A.shape[2], R=bound or R)}
    expand = {**common, "config": _segment_tile("dense_lora_expand", T, info.max_len, N=B.shape[1], R=bound or R)}
    if chunked:
        t = chunked_sgmv_shrink(xk, A, seg_indptr, weight_indices, ranks, info.permutation, **shrink)
        chunked_sgmv_expand(t, B, seg_indptr, weight_indices, ranks, scalings, info.permutation, target.tensor,
                            **expand)
    else:
        t = segmented_lora_a(xk, A, seg_indptr, weight_indices, ranks, permutation=info.permutation, **shrink)
        segmented_lora_b(t, B, seg_indptr, weight_indices, ranks, scalings, target.tensor,
                         permutation=info.permutation, **expand)
    target.merge(info.token_lora_mapping)


class MoEDeltas:
    """The MoE-LoRA stages of one kernel backend (module docstring).

    Args:
        spec: the layer spec (E, top_k, max_loras, dtype, virtual experts).
    """

    def __init__(self, spec: LoRALayerSpec) -> None:
        self.spec = spec

    # --- alignment -----------------------------------------------------------------------------

    def block_m(self, num_tokens: int) -> int:
        """BLOCK_M of the per-slot alignment for ``num_tokens`` rows (a capacity in graph mode)."""
        s = self.spec
        return moe_block_m(num_tokens, s.top_k, s.E, s.max_loras)

    def alignment(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> tuple[AlignOutput, int]:
        """The per-slot alignment of ``topk_ids`` [T, k] with the info's token mapping and enabled
        slots: (AlignOutput, BLOCK_M). Fresh buffers, one launch."""
        T = topk_ids.shape[0]
        block_m = self.block_m(T)
        out = moe_lora_align_block_size(topk_ids, info.token_lora_mapping, self.spec.E, block_m,
                                        self.spec.max_loras, info.adapter_enabled)
        return out, block_m

    def _virtual(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> AlignOutput:
        _, align = virtual_align(topk_ids, info.token_lora_mapping, self.spec.E, self.spec.max_loras)
        return align

    def aligned(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> AlignOutput:
        """The alignment of ``topk_ids`` (contiguous) and info, made now: per slot, or over virtual
        experts with ``spec.virtual_experts`` (module docstring)."""
        return self._virtual(topk_ids, info) if self.spec.virtual_experts else self.alignment(topk_ids, info)[0]

    # --- stages --------------------------------------------------------------------------------

    def apply(self, stage: str, inp: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
              info: LoRABatchInfo, topk_weights: torch.Tensor | None = None,
              align: AlignOutput | None = None) -> None:
        """Add the delta of ``stage`` into ``out`` in place.

        Args:
            stage: "gate_up" (inp = x [T, H], out [T, k, 2I]) or "down" (inp = h [T·k, I], out
                [T, k, H], topk_weights [T, k]).
            align: :meth:`aligned` of the same ``topk_ids`` and info (None: aligned now).
        """
        bound = rank_bound(weights, STAGE_MODULES[stage], info)
        if bound == 0:
            return
        dtype = self.spec.dtype
        topk_ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        align = align if align is not None else self.aligned(topk_ids, info)
        inp_k = _in_dtype(inp, dtype)
        if topk_weights is not None and not topk_weights.is_contiguous():
            topk_weights = topk_weights.contiguous()
        target = _Target(out, dtype)
        k = self.spec.top_k
        if self.spec.virtual_experts:
            virtual_moe_lora_delta(stage, inp_k, target.tensor, weights, align, top_k=k, topk_weights=topk_weights)
        else:
            moe_lora_delta(stage, inp_k, target.tensor, weights, align, top_k=k, topk_weights=topk_weights,
                           adapter_enabled=info.adapter_enabled, max_rank=bound)
        target.merge(info.token_lora_mapping)
