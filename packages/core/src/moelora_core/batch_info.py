"""Batch metadata handed from a backend's ``prepare`` to its delta calls (DESIGN.md §3).

Field names follow SGLang's LoRA backends (``LoRABatchInfo`` in ``sglang/srt/lora/utils.py``) and
the MoE-LoRA PRs that added ``MoELoRABatchInfo``; the semantics here are moelora's contract.

Host fields vs device fields: host fields are Python values a kernel launch uses (grid sizes,
loop bounds). In graph mode (``use_cuda_graph=True``) every host number is the *capacity* fixed at
capture, and the live counts are read by the kernels from the device buffers, whose unused tails
are reset (segment pointers to the last live offset, weight indices and token mappings to -1).
Device fields of a graph-mode info are views of the backend's static buffers: their ``data_ptr``
never changes between batches of one graph family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moelora_core.forward_mode import ForwardMode


@dataclass
class MoELoRABatchInfo:
    """Per-request and per-token metadata read by the MoE-LoRA kernels.

    The MoE path always reads per-request fields, whatever segmentation the backend uses for
    dense LoRA (csgmv chunks are not requests).

    Attributes:
        seg_indptr: device int32 [bs + 1]; token offsets of each request. Graph mode: [capacity + 1],
            tail entries equal the last live offset (empty segments).
        req_to_lora: device int32 [bs]; slot of each request, ``NO_ADAPTER`` (-1) for base requests
            and rank-0 slots. Graph mode: tail is -1.
        adapter_enabled: device int32 [max_loras]; 1 where a slot is used by this batch. Kernels
            exit early for programs of disabled slots.
        token_lora_mapping: device int32 [num_tokens]; slot of every token, -1 = none. Graph mode:
            [token capacity], tail is -1, so padded rows add nothing.
        num_experts: host int E of the layer (the expert-id bound; ids outside ``[0, E)`` add no
            LoRA delta).
        max_loras: host int, number of slots.
    """

    seg_indptr: torch.Tensor
    req_to_lora: torch.Tensor
    adapter_enabled: torch.Tensor
    token_lora_mapping: torch.Tensor
    num_experts: int
    max_loras: int


@dataclass
class LoRABatchInfo:
    """Metadata for one batch, produced by ``Backend.prepare`` from a ``BatchSpec``.

    Attributes:
        forward_mode: host; EXTEND, DECODE or IDLE.
        bs: host int; requests in the batch (graph mode: request capacity).
        num_tokens: host int; tokens in the batch (graph mode: token capacity, the row count of
            the static activations).
        num_segments: host int S; segments the dense kernels iterate over (graph mode: capacity).
            ``triton``: one per request in EXTEND, one per adapter in DECODE, 16-token tiles in
            the prefill graph; ``csgmv``: adapter-sorted chunks.
        max_len: host int; longest segment (graph mode: capacity, e.g. the tile or chunk size).
        seg_indptr: device int32 [S + 1]; token offsets of the segments (in permuted order where
            ``permutation`` is set). Graph tails equal the last live offset.
        seg_lens: device int32 [S]; ``seg_indptr[1:] - seg_indptr[:-1]``. Graph tails are 0.
        weight_indices: device int32 [S]; slot of each segment, -1 = no adapter. Graph tails -1.
        lora_ranks: device int32 [max_loras]; per-slot rank (0 = empty slot).
        scalings: device fp32 [max_loras]; per-slot adapter-level σ (kernels use the per-module σ
            of ``LoRAWeights``, equal unless rank_pattern / alpha_pattern override a module).
        permutation: device int64 [num_tokens] or None; ``permutation[i]`` is the original token
            row read at sorted position i (csgmv always; triton in DECODE). Graph tails map to
            padding rows, whose mapping is -1.
        req_seg_indptr: device int32 [bs + 1]; token offsets per request, always per request.
        req_weight_indices: device int32 [bs]; slot per request (-1 = none), always per request.
        has_active_lora: host bool; True if any token uses an adapter (from host lists). True
            during graph capture so the LoRA kernels are recorded; they exit early on device.
        use_cuda_graph: host bool; whether device fields are static graph buffers.
        moe: the MoE fields (per request and per token).
        private: the backend's own metadata for this batch (any keys; the suite and the engine
            never read or write it). A backend that needs more than the fields above puts it here
            in ``prepare``; in graph mode its tensors must be static buffers too.
    """

    forward_mode: ForwardMode
    bs: int
    num_tokens: int
    num_segments: int
    max_len: int
    seg_indptr: torch.Tensor
    seg_lens: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    permutation: torch.Tensor | None
    req_seg_indptr: torch.Tensor
    req_weight_indices: torch.Tensor
    has_active_lora: bool
    use_cuda_graph: bool
    moe: MoELoRABatchInfo
    private: dict[str, Any] = field(default_factory=dict)

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor of the info by dotted name (for address and tail checks)."""
        out = {
            name: getattr(self, name)
            for name in (
                "seg_indptr", "seg_lens", "weight_indices", "lora_ranks", "scalings",
                "permutation", "req_seg_indptr", "req_weight_indices",
            )
            if getattr(self, name) is not None
        }
        for name in ("seg_indptr", "req_to_lora", "adapter_enabled", "token_lora_mapping"):
            out[f"moe.{name}"] = getattr(self.moe, name)
        return out
