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

- ``moe_forward`` (subclasses with ``fused_moe = True``: the ``triton-fused`` variant): the whole
  MoE layer with the deltas fused into the base GEMMs (``moelora_kernels.fused_moe(fused_lora=)``).

Capabilities: fp32 / fp16 / bf16 (bf16 computes on CUDA only), both graph families, prefill modes
full and breakable, virtual experts (``spec.virtual_experts`` switches the MoE path), shared MoE
alignment, no rank or request cap; ``fused_moe`` where the subclass says so. The CPU device is
declared only under the Triton interpreter (``TRITON_INTERPRET=1``), where the kernels can run there.
"""

from __future__ import annotations

import torch

from moelora_backends import __version__
from moelora_backends.deltas import STAGE_MODULES, MoEDeltas, _in_dtype, dense_delta, rank_bound
from moelora_backends.segmentation import check_segment_capacity
from moelora_core.align import AlignOutput
from moelora_core.backend_base import BackendBase
from moelora_core.backend_checks import check_floating, check_shape, check_topk_ids
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import LaunchSizes
from moelora_core.weights import LoRAWeights
from moelora_kernels import FusedLoRAInputs, fused_moe, token_lora_mapping
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
    #: Declares ``fused_moe``: :meth:`moe_forward` is then part of the protocol it serves.
    fused_moe = False
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
            fused_moe=self.fused_moe,
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

    # --- fused MoE (capability fused_moe) ----------------------------------------------------------

    def moe_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    base_weights: MoEBaseWeights, weights: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
        """The MoE layer with LoRA, the deltas fused into the base GEMMs (DESIGN.md §5 ``fused_moe``):
        ``moelora_kernels.fused_moe(fused_lora=...)`` over the base alignment of ``topk_ids``, each
        row adding its own token's slot's delta (the info's token mapping) inside the base GEMMs
        (gate_up per slice with its delta, the activation, down with its router-weighted delta, the
        top-k sum). Every batch, an all-base one too, takes this path; base rows run the same
        kernels and tiles as the LoRA-free layer and come out bit-identical to it. Intermediates are
        rounded to the pool's dtype (as the kernels store them); y is in x's dtype.

        Args:
            x: [T, H] floating activations (cast to the pool's dtype). topk_ids: [T, k] int32/int64
                (< 0: not here; [E, E_base): base experts without LoRA). topk_weights: [T, k].
            base_weights: the layer's base experts, in the pool's dtype (GPT-OSS biases and
                activation followed).
            weights, info: the pool and this batch's info.

        Returns:
            y [T, H] in x's dtype.

        Raises:
            InvalidFieldError: a backend that does not declare ``fused_moe``; shapes that do not match
                the spec and the info's tokens; base weights of another shape or dtype than the spec.
        """
        if not self.fused_moe:
            raise InvalidFieldError("moe_forward", f"backend {self.name!r} does not declare fused_moe")
        T = self._check_moe(info, topk_ids, weights)
        s = self.spec
        check_shape(info, "x", x, (T, s.H))
        check_shape(info, "topk_weights", topk_weights, (T, s.top_k))
        check_floating(x=x, topk_weights=topk_weights)
        w_gu, w_d = base_weights.w_gate_up, base_weights.w_down
        if w_gu.dim() != 3 or w_gu.shape[1:] != (2 * s.I, s.H) or w_d.shape[1:] != (s.H, s.I) \
                or w_gu.shape[0] < s.E or w_d.shape[0] != w_gu.shape[0]:
            raise InvalidFieldError("base_weights", f"w_gate_up {tuple(w_gu.shape)} / w_down {tuple(w_d.shape)} do "
                                                    f"not fit the spec (E={s.E}, H={s.H}, I={s.I})")
        if w_gu.dtype != s.dtype or w_d.dtype != s.dtype:
            raise InvalidFieldError("base_weights", f"dtype {w_gu.dtype} / {w_d.dtype}, the pool's is {s.dtype}")
        if T == 0:
            return torch.zeros(0, s.H, dtype=x.dtype, device=x.device)
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        bounds = [rank_bound(weights, modules, info) for modules in STAGE_MODULES.values()]
        max_rank = None if None in bounds or max(bounds) == 0 else max(bounds)
        act = base_weights.activation
        y = fused_moe(_in_dtype(x, s.dtype), ids, topk_weights.contiguous(), w_gu, w_d,
                      activation=act.kind, alpha=act.alpha, limit=act.limit, b_gate_up=base_weights.b_gate_up,
                      b_down=base_weights.b_down,
                      fused_lora=FusedLoRAInputs(weights, info.token_lora_mapping, info.adapter_enabled,
                                                 max_rank))
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # --- for the suite and tests ---------------------------------------------------------------------

    def moe_alignment(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> tuple[AlignOutput, int]:
        """This backend's per-slot MoE alignment of ``topk_ids`` [T, k] for ``info`` (the suite's P07
        checks it against the alignment contract): (AlignOutput, BLOCK_M)."""
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        return self._moe.alignment(ids.to(self.spec.device), info)
