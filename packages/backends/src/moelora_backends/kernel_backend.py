"""What ``triton`` and ``csgmv`` share: the ``Backend`` protocol (DESIGN.md §5) on ``moelora_kernels``.

A subclass says only how it segments a batch for the dense kernels — eagerly
(:meth:`KernelBackend.eager_segmentation`) and per graph family (:meth:`KernelBackend.family_layout`:
the segmentation and its capacities) — and whether the dense kernels read the intermediate by
sorted position (chunked SGMV). Everything else is here:

- ``prepare``: validation (:mod:`moelora_core.backend_checks`, shared with the reference backend),
  then :mod:`.metadata` (host lists → pinned staging → device; the token
  mapping kernel from the per-request fields); ``Fallback`` over a family's capacity, before any
  write;
- ``init_decode_graph(max_bs, tokens_per_request)`` / ``init_prefill_graph(max_num_tokens,
  max_num_requests)``: each family's static buffers, once, sized from its capacities (no fixed
  request cap);
- the delta calls (:mod:`.deltas`): argument checks on host shapes, then the kernels; nothing when
  ``info.has_active_lora`` is False (an eager IDLE or all-base batch launches no kernel).

Capabilities: fp32 / fp16 / bf16 (bf16 computes on CUDA only), both graph families, prefill modes
full and breakable, virtual experts (``spec.virtual_experts`` switches the MoE path), no rank or
request cap. The CPU device is declared only under the Triton interpreter (``TRITON_INTERPRET=1``),
where the kernels can run there.
"""

from __future__ import annotations

import torch

from moelora_backends import __version__
from moelora_backends.deltas import MoEDeltas, dense_delta
from moelora_backends.metadata import PER_REQUEST, Capacity, EagerMetadata, GraphFamily, build_info
from moelora_backends.segmentation import Segmentation, check_segment_capacity
from moelora_core.align import AlignOutput
from moelora_core.backend_checks import (
    FamilyCapacity,
    check_batch,
    check_dense_module,
    check_floating,
    check_shape,
    check_topk_ids,
    check_weights,
    initialised_family,
    needs_allocation,
)
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities, Fallback
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights
from moelora_kernels._common import interpreting


class KernelBackend:
    """The protocol on moelora's kernels; subclasses choose the dense segmentation (module doc).

    Args:
        spec: the layer spec (sizes, slots, R, dtype, device, virtual experts).

    Raises:
        InvalidFieldError: ``spec`` is not a ``LoRALayerSpec``.
    """

    name = "kernel"
    #: Dense kernels read the rank-wide intermediate by sorted position (chunked SGMV).
    chunked = False
    #: The (offsets, slots) fields the MoE token mapping is made from: always the per-request ones.
    moe_fields: tuple[str, str] = PER_REQUEST

    def __init__(self, spec: LoRALayerSpec) -> None:
        if not isinstance(spec, LoRALayerSpec):
            raise InvalidFieldError("spec", f"must be a LoRALayerSpec, got {type(spec).__name__}")
        self.version = __version__
        self.spec = spec
        self._families: dict[str, GraphFamily] = {}
        self._eager = EagerMetadata(spec.device, spec.max_loras)
        self._moe = MoEDeltas(spec)

    # --- what a subclass decides ---------------------------------------------------------------

    def eager_segmentation(self, batch: BatchSpec) -> Segmentation:
        """The dense segmentation of ``batch`` in an eager forward."""
        raise NotImplementedError

    def family_layout(self, family: str, max_requests: int, max_tokens: int,
                      tokens_per_request: int | None) -> tuple[Capacity, object]:
        """(capacities, segmentation function) of a graph family with these capacities."""
        raise NotImplementedError

    # --- capabilities --------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        devices = {"cuda", "cpu"} if interpreting() else {"cuda"}
        return Capabilities(
            dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
            devices=frozenset(devices),
            graph_families=frozenset({"decode", "prefill"}),
            prefill_graph_modes=frozenset({"full", "breakable"}),
            virtual_experts=True,
            fused_moe=False,
            max_rank=None,
            max_requests=None,
            fused_shared_experts=True,
            shared_moe_alignment=True,
        )

    # --- graph families --------------------------------------------------------------------------

    def init_decode_graph(self, max_bs: int, tokens_per_request: int = 1) -> None:
        """Allocate the decode family for ``max_bs`` requests of ``tokens_per_request`` tokens.

        Raises:
            InvalidFieldError: a size < 1, capacities over the launch limit, or a second call with
                other capacities (static buffers are allocated once).
        """
        self._init_family(FamilyCapacity.decode(max_bs, tokens_per_request))

    def init_prefill_graph(self, max_num_tokens: int, max_num_requests: int) -> None:
        """Allocate the prefill family for up to ``max_num_tokens`` tokens in ``max_num_requests``
        requests (any number of requests: no fixed cap).

        Raises:
            InvalidFieldError: as :meth:`init_decode_graph`.
        """
        self._init_family(FamilyCapacity.prefill(max_num_tokens, max_num_requests))

    def _init_family(self, capacity: FamilyCapacity) -> None:
        existing = self._families.get(capacity.family)
        if not needs_allocation(existing.capacity if existing is not None else None, capacity):
            return  # allocated once; graphs captured on these buffers stay valid
        name = capacity.family
        cap, segmentation = self.family_layout(name, capacity.max_requests, capacity.max_tokens,
                                               capacity.tokens_per_request)
        check_segment_capacity(name, cap.segments, cap.max_len)
        self._families[name] = GraphFamily.allocate(capacity, cap, segmentation, self.spec.device)

    # --- prepare -------------------------------------------------------------------------------

    def prepare(self, batch: BatchSpec, family: str | None = None) -> LoRABatchInfo | Fallback:
        """Metadata for ``batch`` from its host lists (no device reads).

        Args:
            batch: the batch.
            family: None (eager: fresh tensors sized to the batch), "decode" or "prefill" (write
                that family's static buffers in place; the info's host numbers are capacities).

        Returns:
            The info, or ``Fallback(reason)`` when the batch exceeds the family's capacities (more
            requests or tokens, a non-DECODE batch or another ``tokens_per_request`` in the decode
            family); nothing was written then.

        Raises:
            InvalidFieldError: another slot count, a rank > R, an unknown or uninitialised family.
        """
        check_batch(batch, self.spec)
        s = self.spec
        if family is None:
            t, cap = self._eager.write(batch, self.eager_segmentation(batch), self.moe_fields)
            return build_info(batch, t, cap, num_experts=s.E, max_loras=s.max_loras,
                              has_active_lora=batch.has_active_lora, use_cuda_graph=False,
                              moe_fields=self.moe_fields)
        fam = initialised_family(self._families, family)
        reason = fam.capacity.fallback_reason(batch)
        if reason is not None:
            return Fallback(reason)
        t = fam.write(batch, fam.segmentation(batch), s.max_loras, self.moe_fields)
        # During capture the LoRA kernels must be recorded: has_active_lora is True; they exit early
        # on the device for slots the batch does not use.
        return build_info(batch, t, fam.cap, num_experts=s.E, max_loras=s.max_loras, has_active_lora=True,
                          use_cuda_graph=True, moe_fields=self.moe_fields)

    # --- argument checks (host shapes only) --------------------------------------------------------

    def _check_moe(self, info: LoRABatchInfo, topk_ids: torch.Tensor, weights: LoRAWeights) -> int:
        # The kernels read weights of the spec's dtype and int32 / int64 expert ids.
        check_weights(self.spec, weights)
        return check_topk_ids(info, topk_ids, self.spec.top_k, (torch.int32, torch.int64))

    # --- deltas --------------------------------------------------------------------------------

    def moe_align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> AlignOutput:
        """The MoE alignment of ``topk_ids`` [T, k] for ``info`` (per slot, or over virtual experts),
        made once per layer forward and passed as ``align=`` to both delta calls of that layer
        (capability ``shared_moe_alignment``). One launch; fresh buffers.

        Raises:
            InvalidFieldError: ``topk_ids`` of another shape than the info's tokens × top_k.
        """
        check_topk_ids(info, topk_ids, self.spec.top_k, (torch.int32, torch.int64))
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        return self._moe.aligned(ids, info)

    def moe_gate_up_delta(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, *, align: AlignOutput | None = None) -> None:
        """Add σ_gate·B_gate(A_gate x) into columns [:I] and σ_up·B_up(A_up x) into [I:] of
        ``gate_up_out`` [T, k, 2I] in place, before the activation. ``align``: this layer's
        :meth:`moe_align` of the same ``topk_ids`` and ``info`` (None: aligned here).

        Raises:
            InvalidFieldError: shapes that do not match the spec and the info's token count; a
                non-floating ``x`` or ``gate_up_out``.
        """
        T = self._check_moe(info, topk_ids, weights)
        s = self.spec
        check_shape(info, "x", x, (T, s.H))
        check_shape(info, "gate_up_out", gate_up_out, (T, s.top_k, 2 * s.I))
        check_floating(x=x, gate_up_out=gate_up_out)
        if info.has_active_lora and T:
            self._moe.apply("gate_up", x, topk_ids, gate_up_out, weights, info, align=align)

    def moe_down_delta(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       down_out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, *,
                       align: AlignOutput | None = None) -> None:
        """Add w_k·σ_down·B_down(A_down h) into ``down_out`` [T, k, H] in place. ``align``: as in
        :meth:`moe_gate_up_delta`.

        Raises:
            InvalidFieldError: shapes that do not match the spec and the info's token count; a
                non-floating ``h``, ``topk_weights`` or ``down_out``.
        """
        T = self._check_moe(info, topk_ids, weights)
        s = self.spec
        check_shape(info, "h", h, (T * s.top_k, s.I))
        check_shape(info, "topk_weights", topk_weights, (T, s.top_k))
        check_shape(info, "down_out", down_out, (T, s.top_k, s.H))
        check_floating(h=h, topk_weights=topk_weights, down_out=down_out)
        if info.has_active_lora and T:
            self._moe.apply("down", h, topk_ids, down_out, weights, info, topk_weights=topk_weights, align=align)

    def dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                    info: LoRABatchInfo) -> None:
        """Add σ·B(A x) of dense ``module`` into ``out`` [T, out] in place.

        Raises:
            InvalidFieldError: a module not in the spec, shapes that do not match, a non-floating
                ``x`` or ``out``.
        """
        check_weights(self.spec, weights)
        fin, fout = check_dense_module(self.spec, module)
        T = info.moe.token_lora_mapping.numel()
        check_shape(info, "x", x, (T, fin))
        check_shape(info, "out", out, (T, fout))
        check_floating(x=x, out=out)
        if info.has_active_lora and T:
            dense_delta(module, x, out, weights, info, chunked=self.chunked)

    # --- for the suite and tests ---------------------------------------------------------------------

    def moe_alignment(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> tuple[AlignOutput, int]:
        """This backend's per-slot MoE alignment of ``topk_ids`` [T, k] for ``info`` (the suite's P07
        checks it against the alignment contract): (AlignOutput, BLOCK_M)."""
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        return self._moe.alignment(ids.to(self.spec.device), info)

    def static_buffers(self, family: str) -> dict[str, torch.Tensor]:
        """The family's static buffers by name (addresses, tails, untouched fallbacks).

        Raises:
            InvalidFieldError: the family is not initialised.
        """
        return {name: b.tensor for name, b in initialised_family(self._families, family).buffers.items()}

