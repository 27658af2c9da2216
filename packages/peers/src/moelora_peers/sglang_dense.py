"""Dense (q/k/v/o, shared-expert) LoRA through SGLang 0.5.23's csgmv kernels, as its default LoRA
backend runs them.

``ChunkedSgmvLoRABackend.run_lora_a_sgemm`` / ``run_lora_b_sgemm`` (sglang/srt/lora/backend/
chunked_backend.py) call ``chunked_sgmv_lora_shrink_forward(x, A, batch_info, num_slices)`` and
``chunked_sgmv_lora_expand_forward(shrink, B, batch_info, slice_offsets, max_slice_size,
base_output)``; one module is one slice here (the protocol's ``dense_delta`` is per module), so
every call is the single-slice form SGLang uses for ``o_proj``. σ is applied by the expand kernel
from ``batch_info.scalings[slot]``. SGLang fills that vector with one σ per adapter (``lora_alpha /
r`` of the adapter config: SGLang 0.5.23 reads no ``rank_pattern`` / ``alpha_pattern``); the view
passed here carries the module's own σ per slot (``LoRAWeights.scalings(module)``), so the kernels
are tested on what the adapter file means (conformance/docs/peers.md, "σ per module"). Ranks
likewise: SGLang's ``batch_info.lora_ranks`` is one rank per adapter; the view carries the module's
own (``LoRAWeights.ranks(module)``).

The batch info SGLang's kernels read has SGLang's field names (moelora's ``LoRABatchInfo`` follows
them) with one difference written here: SGLang gives the base model a pool slot of rank 0
(``LoRAMemoryPool.prepare_lora_batch``: uid None takes a buffer slot, zeroed), so its segments never
carry -1; moelora's base segments carry ``NO_ADAPTER`` (-1), which the kernels would use as an index
(``lora_ranks[-1]``). The view passed to the kernels maps -1 to an extra slot ``L`` of rank 0
(``lora_ranks`` and ``scalings`` extended by one entry), on the device, inside the call (so a
captured graph replays the mapping of each batch).
"""

from __future__ import annotations

import types

import torch

from moelora_core.batch_info import LoRABatchInfo
from moelora_core.weights import LoRAWeights
from moelora_peers import sglang_modules
from moelora_peers.sglang_pool import SGLangPool


def sglang_batch_view(info: LoRABatchInfo, ranks: torch.Tensor, scalings: torch.Tensor) -> types.SimpleNamespace:
    """The fields SGLang's csgmv kernels read, base segments on an extra rank-0 slot; ``ranks`` [L]
    int32 and ``scalings`` [L] fp32 the module's rank and σ per slot (module docstring)."""
    L = ranks.shape[0]
    wi = info.weight_indices
    return types.SimpleNamespace(
        bs=info.req_weight_indices.numel(), num_segments=info.num_segments, max_len=info.max_len,
        use_cuda_graph=info.use_cuda_graph, seg_indptr=info.seg_indptr, permutation=info.permutation,
        weight_indices=torch.where(wi < 0, torch.full_like(wi, L), wi),
        lora_ranks=torch.cat([ranks.to(torch.int32), ranks.new_zeros(1, dtype=torch.int32)]),
        scalings=torch.cat([scalings.to(torch.float32), scalings.new_zeros(1, dtype=torch.float32)]),
    )


def csgmv_dense_delta(pool: SGLangPool, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                      info: LoRABatchInfo) -> None:
    """Add σ·B(A x) of dense ``module`` into ``out`` [T, out] with SGLang's csgmv shrink and expand.

    Args:
        pool: the SGLang-layout copy (dense A [L, R, in], B [L, out, R], σ not folded).
        x: [T, in]. out: [T, out] (a strided view is fine: the expand kernel takes its strides).
    """
    shrink = sglang_modules.module("csgmv_shrink").chunked_sgmv_lora_shrink_forward
    expand = sglang_modules.module("csgmv_expand").chunked_sgmv_lora_expand_forward
    b = pool.buffers(weights)
    A, B = b.dense_a[module], b.dense_b[module]
    view = sglang_batch_view(info, weights.ranks(module), weights.scalings(module))
    xs = x if x.is_contiguous() else x.contiguous()
    inter = shrink(x=xs.to(A.dtype), weights=A, batch_info=view, num_slices=1)
    expand(x=inter, weights=B, batch_info=view, slice_offsets=pool.slice_offsets(module),
           max_slice_size=B.shape[1], base_output=out, slice_offsets_cpu=pool.slice_offsets_cpu(module))
