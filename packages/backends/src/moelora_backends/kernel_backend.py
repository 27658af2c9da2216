"""What ``triton`` and ``csgmv`` share: the ``Backend`` protocol (DESIGN.md §5) on ``moelora_kernels``.

Built on :class:`moelora_core.backend_base.BackendBase` (``prepare``, the graph families, the argument
checks, the metadata machinery of :mod:`moelora_core.metadata`, shared with the reference backend). A
subclass says only how it segments a batch for the dense kernels — eagerly
(:meth:`~moelora_core.backend_base.BackendBase.eager_segmentation`) and per graph family
(:meth:`~moelora_core.backend_base.BackendBase.family_layout`: the segmentation and its launch sizes)
— and whether the dense kernels read the intermediate by sorted position (chunked SGMV). What is
kernel-specific is here:

- the token map on the device (``moelora_kernels.token_lora_mapping``, one launch, from the
  request segments);
- the deltas (:mod:`.deltas`) on the kernels; nothing when ``info.has_active_lora`` is False (an
  eager IDLE or all-base batch launches no kernel);
- ``moe_align``: one MoE alignment per layer forward, shared by its two stages (``align=``);
- launch sizes within CUDA's grid limits.

Capabilities: fp32 / fp16 / bf16 (bf16 computes on CUDA only), both graph families, prefill modes
full and breakable, virtual experts (``spec.virtual_experts`` switches the MoE path), shared MoE
alignment, no rank or request cap; no ``fused_moe`` (the caller runs the base MoE). The CPU device is
declared only under the Triton interpreter (``TRITON_INTERPRET=1``), where the kernels can run there.
"""

from __future__ import annotations

import torch

from moelora_backends import __version__
from moelora_backends.deltas import MoEDeltas, dense_delta
from moelora_backends.segmentation import check_segment_capacity
from moelora_core.align import AlignOutput
from moelora_core.backend_base import BackendBase
from moelora_core.backend_checks import check_topk_ids
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import LaunchSizes
from moelora_core.weights import LoRAWeights
from moelora_kernels import token_lora_mapping
from moelora_kernels._common import interpreting


def map_tokens_on_device(req_seg_indptr: torch.Tensor, req_weight_indices: torch.Tensor, max_loras: int,
                         mapping_out: torch.Tensor, enabled_out: torch.Tensor) -> None:
    """The kernel backends' ``TokenMapper``: ``token_lora_mapping`` and ``adapter_enabled`` from the
    request segments, on the device (one launch; tails past the live tokens become -1)."""
    token_lora_mapping(req_seg_indptr, req_weight_indices, max_loras=max_loras, mapping_out=mapping_out,
                       adapter_enabled_out=enabled_out)


class KernelBackend(BackendBase):
    """The protocol on moelora's kernels; subclasses choose the dense segmentation (module doc).

    Args:
        spec: the layer spec (sizes, slots, R, dtype, device, virtual experts).

    Raises:
        InvalidFieldError: ``spec`` is not a ``LoRALayerSpec``.
    """

    name = "kernel"
    #: Dense kernels read the rank-wide intermediate by sorted position (chunked SGMV).
    chunked = False
    token_mapper = staticmethod(map_tokens_on_device)
    #: The kernels read weights of the spec's dtype and int32 / int64 expert ids.
    weights_same_dtype = True
    topk_id_dtypes = (torch.int32, torch.int64)
    #: ``LoRALayerSpec.base_quant`` values served (``Capabilities.base_quants``; DESIGN.md §1).
    base_quants: frozenset[str] = frozenset({"none"})

    def __init__(self, spec: LoRALayerSpec) -> None:
        super().__init__(spec, __version__)
        self._moe = MoEDeltas(spec)

    # --- capabilities --------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        devices = {"cuda", "cpu"} if interpreting() else {"cuda"}
        return Capabilities(
            dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
            devices=frozenset(devices),
            graph_families=frozenset({"decode", "prefill"}),
            prefill_graph_modes=frozenset({"full", "breakable"}),
            virtual_experts=True,
            max_rank=None,
            max_requests=None,
            fused_shared_experts=True,
            shared_moe_alignment=True,
            shared_expert_factors=True,
            base_quants=self.base_quants,
        )

    def check_family_sizes(self, family: str, sizes: LaunchSizes) -> None:
        """Refuse launch sizes past CUDA's grid limits (segments, tiles of the longest segment)."""
        check_segment_capacity(family, sizes.segments, sizes.max_len)

    # --- deltas --------------------------------------------------------------------------------

    def moe_align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> AlignOutput | None:
        """The MoE alignment of ``topk_ids`` [T, k] for ``info`` (per slot, or over virtual experts),
        made once per layer forward and passed as ``align=`` to both delta calls of that layer
        (capability ``shared_moe_alignment``). One launch; fresh buffers. None, launching nothing,
        for a batch whose delta calls launch nothing (no active adapter, or no token: an IDLE batch).

        Raises:
            InvalidFieldError: ``topk_ids`` of another shape than the info's tokens × top_k.
        """
        T = check_topk_ids(info, topk_ids, self.spec.top_k, self.topk_id_dtypes)
        if not (info.has_active_lora and T):
            return None
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        return self._moe.aligned(ids, info)

    def compute_moe_delta(self, stage: str, inp: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, topk_weights: torch.Tensor | None,
                          align: object | None) -> None:
        self._moe.apply(stage, inp, topk_ids, out, weights, info, topk_weights=topk_weights, align=align)

    def compute_dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                            info: LoRABatchInfo) -> None:
        dense_delta(module, x, out, weights, info, chunked=self.chunked)

    # --- for the suite and tests ---------------------------------------------------------------------

    def moe_alignment(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> tuple[AlignOutput, int]:
        """This backend's per-slot MoE alignment of ``topk_ids`` [T, k] for ``info`` (the suite's P07
        checks it against the alignment contract): (AlignOutput, BLOCK_M)."""
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        return self._moe.alignment(ids.to(self.spec.device), info)
