"""``BackendBase``: the ``Backend`` protocol's skeleton, shared by every built-in backend (DESIGN.md §5, §6).

Optional for third parties. A subclass supplies only what makes it a different backend:

- its dense segmentation: :meth:`BackendBase.eager_segmentation` (an eager batch) and
  :meth:`BackendBase.family_layout` (a bucket of a graph family: its
  :class:`~moelora_core.metadata.LaunchSizes` and segmentation function);
- how the token map is written on the device: :attr:`BackendBase.token_mapper` (e.g. the Triton
  mapping kernel; default :func:`~moelora_core.metadata.map_tokens_torch`);
- its deltas: :meth:`BackendBase.compute_moe_delta` and :meth:`BackendBase.compute_dense_delta`, called
  only after the argument checks and only when the batch has an active adapter and tokens;
- its :meth:`capabilities`.

Everything else is here, once: ``init_graph(family, capacity)`` (each family's static buffers
allocated once, at its largest bucket, no fixed request cap), ``prepare(batch, family, bucket)``
(checks, ``Fallback`` over the bucket's capacity before any write, the family lookup, the bucket's
views of the family's buffers, the metadata machinery of :mod:`moelora_core.metadata`) and the delta
calls' argument checks (:mod:`moelora_core.backend_checks`). No host sync: only host shapes, host
lists and the info's host fields steer Python. The entry points of the previous protocol version
(``init_decode_graph``, ``init_prefill_graph``) raise :class:`~moelora_core.errors.RenamedError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelora_core.backend_checks import (
    GraphCapacity,
    check_batch,
    check_bucket,
    check_capacity,
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
from moelora_core.errors import InvalidFieldError, RenamedError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import (
    PER_REQUEST,
    EagerMetadata,
    GraphFamily,
    LaunchSizes,
    Segmentation,
    TokenMapper,
    build_info,
    map_tokens_torch,
)
from moelora_core.weights import LoRAWeights


class BackendBase:
    """The protocol's shared skeleton (module docstring).

    Args:
        spec: the layer spec (sizes, slots, R, dtype, device, virtual experts).
        version: the implementation's version string (reports).

    Raises:
        InvalidFieldError: ``spec`` is not a ``LoRALayerSpec``.
    """

    name = "base"
    #: Writes the token map on the device from the request segments.
    token_mapper: TokenMapper = staticmethod(map_tokens_torch)
    #: The (offsets, slots) fields the token mapper reads as the requests: always the request segments
    #: (csgmv chunks are not requests); a class attribute so the suite's mutants can name others.
    mapping_fields: tuple[str, str] = PER_REQUEST
    #: The delta calls require weights in the spec's dtype (kernels) or read any dtype (torch).
    weights_same_dtype: bool = True
    #: Accepted ``topk_ids`` dtypes, or None for any integer dtype.
    topk_id_dtypes: tuple[torch.dtype, ...] | None = None

    def __init__(self, spec: LoRALayerSpec, version: str) -> None:
        if not isinstance(spec, LoRALayerSpec):
            raise InvalidFieldError("spec", f"must be a LoRALayerSpec, got {type(spec).__name__}")
        self.version = version
        self.spec = spec
        self._families: dict[str, GraphFamily] = {}
        self._eager = EagerMetadata(spec.device, spec.max_loras, self.token_mapper, self.mapping_fields)

    # --- what a subclass decides ---------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        raise NotImplementedError

    def eager_segmentation(self, batch: BatchSpec) -> Segmentation:
        """The dense segmentation of ``batch`` in an eager forward."""
        raise NotImplementedError

    def family_layout(self, family: str, capacity: GraphCapacity, family_capacity: GraphCapacity
                      ) -> tuple[LaunchSizes, Callable[[BatchSpec], Segmentation]]:
        """(launch sizes, segmentation function) of a bucket of ``capacity`` in graph family ``family``
        allocated at ``family_capacity`` (``capacity`` is the family's own at allocation). A bucket's
        launch sizes must lie within the family's (:meth:`LaunchSizes.within`): every bucket reads
        views of the family's buffers."""
        raise NotImplementedError

    def check_family_sizes(self, family: str, sizes: LaunchSizes) -> None:
        """Refuse launch sizes the backend cannot run (e.g. past a grid limit); default: any."""

    def compute_moe_delta(self, stage: str, inp: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, topk_weights: torch.Tensor | None,
                          align: object | None) -> None:
        """Add the ``stage`` delta ("gate_up" or "down") into ``out`` in place (arguments checked)."""
        raise NotImplementedError

    def compute_dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                            info: LoRABatchInfo) -> None:
        """Add σ·B(A x) of dense ``module`` into ``out`` in place (arguments checked)."""
        raise NotImplementedError

    # --- graph families --------------------------------------------------------------------------

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        """Allocate graph family ``family``'s static buffers at ``capacity`` (its largest bucket): once,
        no fixed request cap. Every bucket of the family is then prepared over views of them
        (``prepare(batch, family, bucket=...)``).

        Args:
            family: "decode" or "prefill".
            capacity: ``GraphCapacity.decode(max_bs, tokens_per_request)`` or
                ``GraphCapacity.prefill(max_num_tokens, max_num_requests)``.

        Raises:
            InvalidFieldError: an unknown family, a capacity of the other kind or with a size < 1,
                capacities the backend cannot launch, or a second call with another capacity (static
                buffers are allocated once).
        """
        check_capacity(family, capacity)
        existing = self._families.get(family)
        if not needs_allocation(existing.capacity if existing is not None else None, capacity, family):
            return  # allocated once; graphs captured on these buffers stay valid
        launch, segmentation = self.family_layout(family, capacity, capacity)
        self.check_family_sizes(family, launch)
        self._families[family] = GraphFamily.allocate(family, capacity, launch, segmentation, self.spec.device,
                                                      self.token_mapper, self.mapping_fields)

    def init_decode_graph(self, *args: object, **kwargs: object) -> None:
        raise RenamedError("init_decode_graph(max_bs, tokens_per_request)",
                           "init_graph('decode', GraphCapacity.decode(max_bs, tokens_per_request))")

    def init_prefill_graph(self, *args: object, **kwargs: object) -> None:
        raise RenamedError("init_prefill_graph(max_num_tokens, max_num_requests)",
                           "init_graph('prefill', GraphCapacity.prefill(max_num_tokens, max_num_requests))")

    def _bucket_layout(self, fam: GraphFamily, bucket: GraphCapacity
                       ) -> tuple[LaunchSizes, Callable[[BatchSpec], Segmentation]]:
        layout = fam.buckets.get(bucket)
        if layout is None:
            layout = self.family_layout(fam.name, bucket, fam.capacity)
            if not layout[0].within(fam.sizes):
                raise InvalidFieldError("bucket", f"{self.name}: the launch sizes of bucket {bucket} ({layout[0]}) are "
                                                  f"not within the {fam.name} family's buffers ({fam.sizes})")
            fam.buckets[bucket] = layout
        return layout

    # --- prepare -------------------------------------------------------------------------------

    def prepare(self, batch: BatchSpec, family: str | None = None,
                bucket: GraphCapacity | None = None) -> LoRABatchInfo | Fallback:
        """Metadata for ``batch`` from its host lists (no device reads).

        Args:
            batch: the batch.
            family: None (eager: fresh tensors sized to the batch), "decode" or "prefill" (write that
                family's static buffers in place; the info's host numbers are capacities).
            bucket: graph mode: the capacity of the bucket the info is for, within the family's
                (None: the family's own). The info's device fields are views of the family's buffers
                of the bucket's lengths (the same memory for every bucket) and its host numbers the
                bucket's launch sizes.

        Returns:
            The info, or ``Fallback(reason)`` when the batch exceeds the bucket's capacities (more
            requests or tokens, a non-DECODE batch or another ``tokens_per_request`` in the decode
            family); nothing was written then.

        Raises:
            InvalidFieldError: another slot count, a rank > R, an unknown or uninitialised family, a
                bucket outside the family's capacity or with an eager batch.
        """
        check_batch(batch, self.spec)
        if family is None:
            if bucket is not None:
                raise InvalidFieldError("bucket", "an eager prepare (family=None) has no bucket")
            t, launch = self._eager.write(batch, self.eager_segmentation(batch))
            return build_info(t, launch, has_active_lora=batch.has_active_lora, use_cuda_graph=False)
        fam = initialised_family(self._families, family)
        capacity = check_bucket(family, fam.capacity, bucket)
        sizes, segmentation = self._bucket_layout(fam, capacity)
        reason = capacity.fallback_reason(batch, family)
        if reason is not None:
            return Fallback(reason)
        t = fam.write(batch, segmentation(batch), sizes)
        # During capture the LoRA kernels must be recorded: has_active_lora is True; they exit early
        # on the device for slots the batch does not use.
        return build_info(t, sizes, has_active_lora=True, use_cuda_graph=True)

    # --- the delta calls: argument checks (host shapes only), then the subclass's deltas ----------

    def _check_moe(self, info: LoRABatchInfo, topk_ids: torch.Tensor, weights: LoRAWeights) -> int:
        check_weights(self.spec, weights, same_dtype=self.weights_same_dtype)
        if self.topk_id_dtypes is None:
            return check_topk_ids(info, topk_ids, self.spec.top_k)
        return check_topk_ids(info, topk_ids, self.spec.top_k, self.topk_id_dtypes)

    def moe_gate_up_delta(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, *, align: object | None = None) -> None:
        """Add σ_gate·B_gate(A_gate x) into columns [:I] and σ_up·B_up(A_up x) into [I:] of
        ``gate_up_out`` [T, k, 2I] in place, before the activation. ``align``: this layer's
        ``moe_align`` of the same ``topk_ids`` and ``info`` (backends declaring
        ``shared_moe_alignment``; None: aligned inside).

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
            self.compute_moe_delta("gate_up", x, topk_ids, gate_up_out, weights, info, None, align)

    def moe_down_delta(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       down_out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, *,
                       align: object | None = None) -> None:
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
            self.compute_moe_delta("down", h, topk_ids, down_out, weights, info, topk_weights, align)

    def dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                    info: LoRABatchInfo) -> None:
        """Add σ·B(A x) of dense ``module`` into ``out`` [T, out] in place.

        Raises:
            InvalidFieldError: a module not in the spec, shapes that do not match, a non-floating
                ``x`` or ``out``.
        """
        check_weights(self.spec, weights, same_dtype=self.weights_same_dtype)
        fin, fout = check_dense_module(self.spec, module)
        T = info.num_tokens
        check_shape(info, "x", x, (T, fin))
        check_shape(info, "out", out, (T, fout))
        check_floating(x=x, out=out)
        if info.has_active_lora and T:
            self.compute_dense_delta(module, x, out, weights, info)

    # --- for the suite and tests ---------------------------------------------------------------------

    def static_buffers(self, family: str) -> dict[str, torch.Tensor]:
        """The family's whole static buffers by field name (the backend segments are the request
        buffers where the family segments by request), to check addresses, tails, aliasing of buckets
        and untouched fallbacks.

        Raises:
            InvalidFieldError: the family is not initialised.
        """
        return initialised_family(self._families, family).tensors()
