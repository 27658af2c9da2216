"""The protocol-facing part every peer path shares: moelora's ``Backend`` around a peer's call sites.

Thin on purpose. One instance serves an engine's eager steps and every graph bucket of both
families; each family's static buffers are allocated once, at its largest bucket
(``init_graph(family, capacity)``), and every bucket is prepared over views of them
(conformance/docs/migration.md). A path supplies a :class:`PeerPath` — how it re-packs a slot into the peer's
weight layout, its per-layer alignment, its two MoE stages and its dense delta, each calling the
peer's own functions — and :class:`PeerBackend` maps the protocol onto it:

- ``prepare`` and the graph families are :class:`moelora_core.backend_base.BackendBase`'s (moelora's
  metadata machinery): the request segments (SGLang's ``seg_indptr`` / ``req_to_lora`` of
  ``_add_moe_lora_info`` are moelora's ``req_seg_indptr`` / ``req_weight_indices``),
  ``adapter_enabled`` and ``token_lora_mapping``, from the batch's host lists; ranks and σ come from
  the pool per module (``weights.ranks(module)`` / ``weights.scalings(module)``). SGLang's own
  prepare (``ChunkedSgmvLoRABackend.prepare_lora_batch(ForwardBatch, ...)``) takes its server's batch
  object and is not run (conformance/docs/peers.md, "What moelora's protocol cannot express"); a
  path's ``prepare`` hook adds the peer's own metadata where it can be run (vLLM's
  ``PunicaWrapperGPU.update_metadata(LoRAMapping, ...)``);
- the dense segmentation: tokens stably sorted by slot, cut into chunks of SGLang's csgmv chunk
  size (:func:`csgmv_chunk_size`), which SGLang's dense kernels read (``max_len`` is the chunk size,
  their ``BLOCK_M``); in a graph family the chunk size is the family's (its largest bucket's token
  count), the same for every bucket, as SGLang sizes it from ``max_bs`` at graph init;
- ``info.private``: ``family`` (None eager) and ``forward_mode`` (the batch's), which the paths read
  to pick their per-family storage and their phase;
- the slot-load hook re-packs the slot into the peer's layout (σ folded where the peer folds it);
- ``moe_align`` is the path's per-layer alignment (both stages of a layer share it, as SGLang's
  ``build_lora_hooks`` and vLLM's ``add_lora_w13`` → ``add_lora_w2`` do).

``cpu_substitutes`` names every CUDA-only helper the path replaced on this machine (recorded per
cell in ``.reports/peers.json``; empty on a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from moelora_backends.segmentation import chunk_segments, max_chunk_segments
from moelora_core.backend_base import BackendBase
from moelora_core.backend_checks import GraphCapacity
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


#: Diagnostic switch: "1" makes the SGLang legacy and grouped paths declare fp32 on CUDA too, where
#: their ``tl.dot`` calls without ``input_precision`` run TF32 (conformance/docs/peers.md, "fp32 on
#: CUDA"); for the ``TRITON_F32_DEFAULT=ieee`` diagnostic cell only. The report header echoes it.
FP32_ON_CUDA_ENV = "MOELORA_PEERS_FP32_ON_CUDA"


def fp32_declared(device: torch.device | str) -> bool:
    """Whether an SGLang path whose dots default to TF32 declares fp32 on ``device``: off CUDA (the
    Triton interpreter's dots are IEEE), or with :data:`FP32_ON_CUDA_ENV` set to "1"."""
    return torch.device(device).type != "cuda" or os.environ.get(FP32_ON_CUDA_ENV) == "1"


def peer_capabilities(dtypes: set[torch.dtype], *, virtual_experts: bool = False,
                      alignment_reads_disabled_slots: bool = True) -> Capabilities:
    """What every peer path declares but its dtypes (and virtual experts, and whether the consumer
    of its own alignment reads disabled slots' rows): both graph families and prefill modes, ids >= E
    accepted, one alignment per layer, the slot-load hook, per-expert factors only
    (conformance/docs/peers.md, "Capabilities")."""
    return Capabilities(
        dtypes=frozenset(dtypes), devices=frozenset({"cpu", "cuda"}),
        graph_families=frozenset({"decode", "prefill"}), prefill_graph_modes=frozenset({"full", "breakable"}),
        virtual_experts=virtual_experts, fused_shared_experts=True, shared_moe_alignment=True, slot_load_hook=True,
        alignment_reads_disabled_slots=alignment_reads_disabled_slots,
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
        init_graph: ``(family, capacity)`` allocate the path's own per-family storage at the
            family's capacity (called once per family, after moelora's buffers), or None.
        prepare: ``(batch, info, family)`` the path's own per-batch metadata (written into
            ``info.private``; graph families: into that family's storage), or None.
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
    init_graph: Callable[[str, GraphCapacity], None] | None = None
    prepare: Callable[[BatchSpec, LoRABatchInfo, str | None], None] | None = None
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

    def family_layout(self, family: str, capacity: GraphCapacity, family_capacity: GraphCapacity):
        L = self.spec.max_loras
        requests, tokens = capacity.max_requests, capacity.max_tokens
        # The family's chunk size for every bucket: a bucket's chunk count then stays within the
        # family's buffers. max_len is the chunk size itself (SGLang's BLOCK_M, a power of two that
        # ``tl.arange`` needs), fixed at capture.
        size = csgmv_chunk_size(family_capacity.max_tokens)
        sizes = LaunchSizes(requests, tokens, L, max_chunk_segments(tokens, requests, L, size), size, True)
        return sizes, partial(chunk_segments, chunk_size=size)

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        fresh = family not in self._families
        super().init_graph(family, capacity)
        if fresh and self.path.init_graph is not None:
            self.path.init_graph(family, capacity)

    def prepare(self, batch: BatchSpec, family: str | None = None, bucket: GraphCapacity | None = None):
        info = super().prepare(batch, family, bucket)
        if isinstance(info, LoRABatchInfo):
            if family is None:
                info.max_len = csgmv_chunk_size(batch.num_tokens)  # SGLang's BLOCK_M (a power of two)
            info.private.update(family=family, forward_mode=batch.forward_mode)
            if self.path.prepare is not None:
                self.path.prepare(batch, info, family)
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
