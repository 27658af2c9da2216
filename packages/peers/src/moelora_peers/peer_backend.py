"""The protocol-facing part every peer path shares: moelora's ``Backend`` around a peer's call sites.

Thin on purpose (the graph API is about to change: one backend instance and one static buffer set
per graph family). A path supplies a :class:`PeerPath` — how it re-packs a slot into the peer's
weight layout, its per-layer alignment, its two MoE stages and its dense delta, each calling the
peer's own functions — and :class:`PeerBackend` maps the protocol onto it:

- ``prepare`` and the graph families are :class:`moelora_core.backend_base.BackendBase`'s (moelora's
  metadata machinery): the fields SGLang's ``LoRABatchInfo`` / ``MoELoRABatchInfo`` name
  (``seg_indptr``, ``req_to_lora``, ``adapter_enabled``, ``token_lora_mapping``, ``lora_ranks``,
  ``scalings``), from the batch's host lists. The peers' own prepare functions take their servers'
  batch objects (SGLang ``ChunkedSgmvLoRABackend.prepare_lora_batch(ForwardBatch, ...)``, vLLM
  ``PunicaWrapperGPU.update_metadata(LoRAMapping, ...)``) and are not run (conformance/docs/peers.md,
  "What moelora's protocol cannot express");
- the dense segmentation: tokens stably sorted by slot, cut into chunks of SGLang's csgmv chunk
  size (:func:`csgmv_chunk_size`), which SGLang's dense kernels read;
- the slot-load hook re-packs the slot into the peer's layout (σ folded where the peer folds it);
- ``moe_align`` is the path's per-layer alignment (both stages of a layer share it, as SGLang's
  ``build_lora_hooks`` and vLLM's ``add_lora_w13`` → ``add_lora_w2`` do).

``cpu_substitutes`` names every CUDA-only helper the path replaced on this machine (recorded per
cell in ``.reports/peers.json``; empty on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from moelora_backends.segmentation import chunk_segments, max_chunk_segments
from moelora_core.backend_base import BackendBase
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import LaunchSizes, Segmentation
from moelora_core.weights import LoRAWeights

#: SGLang's csgmv chunk sizes (``ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens``,
#: sglang/srt/lora/backend/chunked_backend.py): 16 below 64 tokens, 32 below 256, else 128.
_CHUNK_STEPS = ((256, 128), (64, 32), (0, 16))


def csgmv_chunk_size(num_tokens: int) -> int:
    """SGLang's csgmv chunk size for ``num_tokens`` tokens (a token capacity in graph mode)."""
    return next(size for bound, size in _CHUNK_STEPS if num_tokens >= bound)


def peer_capabilities(dtypes: set[torch.dtype], *, virtual_experts: bool = False) -> Capabilities:
    """What every peer path declares but its dtypes (and virtual experts): both graph families and
    prefill modes, ids >= E accepted, one alignment per layer, the slot-load hook, per-expert factors
    only (conformance/docs/peers.md, "Capabilities")."""
    return Capabilities(
        dtypes=frozenset(dtypes), devices=frozenset({"cpu", "cuda"}),
        graph_families=frozenset({"decode", "prefill"}), prefill_graph_modes=frozenset({"full", "breakable"}),
        virtual_experts=virtual_experts, fused_shared_experts=True, shared_moe_alignment=True, slot_load_hook=True,
    )


@dataclass
class PeerPath:
    """What one peer path supplies (each callable calls the peer's own functions).

    Attributes:
        peer: "sglang" or "vllm". path: the path's name ("legacy", "virtual_experts", ...).
        version: the peer release's version.
        capabilities: what the path declares (honestly: conformance/docs/peers.md per path).
        on_slot_loaded: ``(slot, weights)`` re-pack one slot into the path's private layout.
        align: ``(topk_ids, info) -> object | None`` the layer's alignment (None: nothing to run).
        gate_up: ``(x, topk_ids, gate_up_out, weights, info, align)`` adds the gate_up delta.
        down: ``(h, topk_ids, topk_weights, down_out, weights, info, align)`` adds the down delta.
        dense: ``(module, x, out, weights, info)`` adds a dense delta, or None (not declared).
        alignment: ``(topk_ids, info) -> (AlignOutput, block_m)`` for the suite's exact check of
            the peer's own per-slot alignment, or None (the path has no per-slot alignment).
        cpu_substitutes: CUDA-only helper → what replaced it on this machine.
    """

    peer: str
    path: str
    version: str
    capabilities: Capabilities
    on_slot_loaded: Callable[[int, LoRAWeights], None]
    align: Callable[..., object]
    gate_up: Callable[..., None]
    down: Callable[..., None]
    dense: Callable[..., None] | None = None
    alignment: Callable[..., tuple] | None = None
    cpu_substitutes: dict[str, str] = field(default_factory=dict)


class PeerBackend(BackendBase):
    """moelora's ``Backend`` over a :class:`PeerPath` (module docstring).

    Args:
        spec: the layer spec.
        make_path: ``spec -> PeerPath``.
    """

    topk_id_dtypes = (torch.int32, torch.int64)

    def __init__(self, spec: LoRALayerSpec, make_path: Callable[[LoRALayerSpec], PeerPath]) -> None:
        path = make_path(spec)
        super().__init__(spec, path.version)
        self.path = path
        self.name = f"{path.peer}-{path.path}"
        self.cpu_substitutes = dict(path.cpu_substitutes)
        if path.alignment is not None:
            self.moe_alignment = path.alignment

    def capabilities(self) -> Capabilities:
        return self.path.capabilities

    # --- dense segmentation: SGLang's csgmv chunks ---------------------------------------------------

    def eager_segmentation(self, batch: BatchSpec) -> Segmentation:
        return chunk_segments(batch, csgmv_chunk_size(batch.num_tokens))

    def family_layout(self, family: str, max_requests: int, max_tokens: int, tokens_per_request: int | None):
        L, size = self.spec.max_loras, csgmv_chunk_size(max_tokens)
        # max_len is the chunk size itself (SGLang's BLOCK_M), a capacity fixed at capture.
        sizes = LaunchSizes(max_requests, max_tokens, L, max_chunk_segments(max_tokens, max_requests, L, size),
                            size, True)
        return sizes, partial(chunk_segments, chunk_size=size)

    def prepare(self, batch: BatchSpec, family: str | None = None):
        info = super().prepare(batch, family)
        if isinstance(info, LoRABatchInfo) and family is None:
            info.max_len = csgmv_chunk_size(batch.num_tokens)  # SGLang's BLOCK_M (a power of two)
        return info

    # --- the slot-load hook and the deltas --------------------------------------------------------

    def on_slot_loaded(self, slot: int, weights: LoRAWeights) -> None:
        """Re-pack ``slot`` of ``weights`` into the path's own layout (capability ``slot_load_hook``)."""
        self.path.on_slot_loaded(slot, weights)

    def moe_align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> object | None:
        """The layer's alignment, shared by its two stages (capability ``shared_moe_alignment``)."""
        if not (info.has_active_lora and topk_ids.shape[0]):
            return None
        return self.path.align(topk_ids, info)

    def compute_moe_delta(self, stage: str, inp: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, topk_weights: torch.Tensor | None,
                          align: object | None) -> None:
        if align is None:
            align = self.path.align(topk_ids, info)
        if stage == "gate_up":
            self.path.gate_up(inp, topk_ids, out, weights, info, align)
        else:
            self.path.down(inp, topk_ids, topk_weights, out, weights, info, align)

    def compute_dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                            info: LoRABatchInfo) -> None:
        if self.path.dense is None:
            raise NotImplementedError(f"{self.name}: dense deltas are not part of this path")
        self.path.dense(module, x, out, weights, info)
