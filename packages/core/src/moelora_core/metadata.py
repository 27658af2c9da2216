"""The batch-metadata machinery of every built-in backend: host lists → device tensors, eagerly or
into a graph family's static buffers (DESIGN.md §3, §5, §6).

One machinery, used by ``triton``, ``csgmv`` (``moelora_backends``) and ``reference``
(``moelora_reference``) through :class:`moelora_core.backend_base.BackendBase`; backends differ only
in the dense :class:`Segmentation` they hand in (and its :class:`LaunchSizes` in graph mode) and in
how the MoE token mapping is written:

- from the ``BatchSpec``'s host lists, through pinned double-buffered staging (``PinnedStaging``,
  ``non_blocking`` copies): the segmentation (``seg_indptr``, ``seg_lens``, ``weight_indices``,
  ``permutation``), the per-request fields (``req_seg_indptr``, ``req_weight_indices``, which the
  MoE fields ``moe.seg_indptr`` / ``moe.req_to_lora`` are: per request, whatever the dense
  segmentation), ``lora_ranks`` and ``scalings``;
- the MoE token mapping ``moe.token_lora_mapping`` and ``moe.adapter_enabled``: by a device
  :data:`TokenMapper` from the per-request fields (the kernel backends: one Triton launch;
  an eager IDLE batch launches nothing and stages ``adapter_enabled`` as zeros), or, without one,
  staged from the host lists like every other field (the reference backend).

Eager (``family=None``, :class:`EagerMetadata`): fresh tensors sized to the batch. Graph families
(:class:`GraphFamily`): one set of :class:`~moelora_core.StaticBuffer` per family (decode and prefill
share no storage), sized from the family's launch sizes at init; every batch writes them in place
and resets the tails (offsets to the last live offset, slots and token mappings to -1, lengths to
0, permutation tails to the pad rows themselves). A batch over capacity gets a ``Fallback`` before
anything is written (:meth:`moelora_core.backend_checks.FamilyCapacity.fallback_reason`). No
device value is read on the host anywhere here.

Names: a graph family's buffers are keyed by the info's field names (``"seg_indptr"``, ...,
``"moe.token_lora_mapping"``, ``"moe.adapter_enabled"``); ``moe.seg_indptr`` / ``moe.req_to_lora``
are the per-request buffers themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelora_core.backend_checks import FamilyCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo, MoELoRABatchInfo
from moelora_core.errors import InvalidFieldError
from moelora_core.forward_mode import ForwardMode
from moelora_core.staging import PinnedStaging
from moelora_core.static_buffer import StaticBuffer

I32, I64, F32 = torch.int32, torch.int64, torch.float32

#: int32 fields staged from host lists per batch: (name, length kind, tail fill). Kinds: "seg+1"
#: segment offsets, "seg" per segment, "req+1" request offsets, "req" per request, "slots" per slot,
#: "tok" per token.
INT_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("seg_indptr", "seg+1", 0),
    ("seg_lens", "seg", 0),
    ("weight_indices", "seg", -1),
    ("req_seg_indptr", "req+1", 0),
    ("req_weight_indices", "req", -1),
    ("lora_ranks", "slots", 0),
)
#: The MoE token mapping: written on the device by a :data:`TokenMapper`, or staged from host lists
#: when a backend has none: (name, length kind, tail fill).
MAPPING_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("moe.token_lora_mapping", "tok", -1),
    ("moe.adapter_enabled", "slots", 0),
)
#: The fields the MoE path reads as (offsets, slots) of its requests: the per-request ones, whatever
#: the dense segmentation (csgmv chunks are not requests: sgl-project/sglang#24007).
PER_REQUEST: tuple[str, str] = ("req_seg_indptr", "req_weight_indices")

#: ``mapper(seg_indptr [bs+1], req_to_lora [bs], max_loras, mapping_out [tokens], enabled_out [L])``:
#: writes the token mapping on the device (tails past the live tokens -1), e.g.
#: ``moelora_kernels.token_lora_mapping``.
TokenMapper = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Segmentation:
    """A dense segmentation of a batch as host lists (DESIGN.md §3).

    Attributes:
        seg_indptr: [S + 1] token offsets of the segments (permuted order if ``permutation``).
        weight_indices: [S] slot per segment, ``NO_ADAPTER`` for base tokens.
        permutation: [N] original row at each sorted position, or None (batch order).
    """

    seg_indptr: list[int]
    weight_indices: list[int]
    permutation: list[int] | None

    @classmethod
    def per_request(cls, batch: BatchSpec) -> Segmentation:
        """One segment per request in batch order: ``seg_indptr = req_seg_indptr``, slots per request."""
        return cls(list(batch.req_seg_indptr), list(batch.req_to_lora), None)

    @property
    def num_segments(self) -> int:
        return len(self.weight_indices)

    @property
    def seg_lens(self) -> list[int]:
        """[S] tokens per segment."""
        p = self.seg_indptr
        return [p[i + 1] - p[i] for i in range(len(p) - 1)]

    @property
    def max_len(self) -> int:
        """Longest segment (0 without segments)."""
        return max(self.seg_lens, default=0)


@dataclass(frozen=True)
class LaunchSizes:
    """The sizes of one set of metadata tensors and the host numbers of the launches reading them:
    a graph family's (fixed at init, from its :class:`FamilyCapacity`) or an eager batch's own.

    Attributes:
        requests, tokens, slots: per-request, per-token and per-slot lengths.
        segments: S, segments of the dense launch. max_len: longest segment (a launch bound).
        permuted: whether the segmentation carries a token permutation.
    """

    requests: int
    tokens: int
    slots: int
    segments: int
    max_len: int
    permuted: bool

    def length(self, kind: str) -> int:
        """Elements of a field of length ``kind`` (see :data:`INT_FIELDS`)."""
        return {"seg+1": self.segments + 1, "seg": self.segments, "req+1": self.requests + 1, "req": self.requests,
                "slots": self.slots, "tok": self.tokens}[kind]


def host_lists(batch: BatchSpec, seg: Segmentation) -> dict[str, list]:
    """Every host-staged field of ``batch`` with segmentation ``seg`` (live entries only)."""
    return {
        "seg_indptr": seg.seg_indptr,
        "seg_lens": seg.seg_lens,
        "weight_indices": seg.weight_indices,
        "req_seg_indptr": list(batch.req_seg_indptr),
        "req_weight_indices": list(batch.req_to_lora),
        "lora_ranks": list(batch.lora_ranks),
        "moe.token_lora_mapping": list(batch.token_lora_mapping),
        "moe.adapter_enabled": list(batch.adapter_enabled),
    }


def _map_on_device(mapper: TokenMapper, t: dict[str, torch.Tensor], max_loras: int,
                   moe_fields: tuple[str, str]) -> None:
    indptr, slots = moe_fields
    mapper(t[indptr], t[slots], max_loras, t["moe.token_lora_mapping"], t["moe.adapter_enabled"])


def build_info(batch: BatchSpec, t: dict[str, torch.Tensor], sizes: LaunchSizes, *, num_experts: int,
               max_loras: int, has_active_lora: bool, use_cuda_graph: bool,
               moe_fields: tuple[str, str] = PER_REQUEST) -> LoRABatchInfo:
    """The ``LoRABatchInfo`` over tensors ``t`` with the host numbers of ``sizes``.

    The MoE per-request fields (``moe.seg_indptr``, ``moe.req_to_lora``) are the tensors named by
    ``moe_fields``: the per-request ones (same values by contract; the suite's mutants name others).
    """
    indptr, slots = moe_fields
    moe = MoELoRABatchInfo(seg_indptr=t[indptr], req_to_lora=t[slots], adapter_enabled=t["moe.adapter_enabled"],
                           token_lora_mapping=t["moe.token_lora_mapping"], num_experts=num_experts,
                           max_loras=max_loras)
    indptr, slots = PER_REQUEST
    return LoRABatchInfo(
        forward_mode=batch.forward_mode, bs=sizes.requests, num_tokens=sizes.tokens, num_segments=sizes.segments,
        max_len=sizes.max_len, seg_indptr=t["seg_indptr"], seg_lens=t["seg_lens"],
        weight_indices=t["weight_indices"], lora_ranks=t["lora_ranks"], scalings=t["scalings"],
        permutation=t.get("permutation"), req_seg_indptr=t[indptr], req_weight_indices=t[slots],
        has_active_lora=has_active_lora, use_cuda_graph=use_cuda_graph, moe=moe,
    )


def _staged_int_fields(mapper: TokenMapper | None) -> tuple[tuple[str, str, int], ...]:
    """The int32 fields staged from host lists: all of them without a device mapper."""
    return INT_FIELDS if mapper is not None else INT_FIELDS + MAPPING_FIELDS


class EagerMetadata:
    """Fresh metadata tensors per batch, staged through growable pinned buffers.

    Args:
        device: where the tensors live. max_loras: slots of the pool.
        mapper: writes the token mapping on the device, or None to stage it from host lists.
        moe_fields: the (offsets, slots) fields the device mapper reads (:data:`PER_REQUEST`).
    """

    def __init__(self, device: torch.device, max_loras: int, mapper: TokenMapper | None = None,
                 moe_fields: tuple[str, str] = PER_REQUEST) -> None:
        self.device = device
        self.max_loras = max_loras
        self.mapper = mapper
        self.moe_fields = moe_fields
        self._int = PinnedStaging(0, I32, device)
        self._long = PinnedStaging(0, I64, device)
        self._float = PinnedStaging(max_loras, F32, device)

    @staticmethod
    def _grown(staging: PinnedStaging, needed: int, dtype: torch.dtype, device: torch.device) -> PinnedStaging:
        if needed <= staging.capacity:
            return staging
        # Geometric growth; the old pinned buffers are released by the caching host allocator only
        # after the copies that read them have finished.
        return PinnedStaging(max(needed, 2 * staging.capacity), dtype, device)

    def write(self, batch: BatchSpec, seg: Segmentation) -> tuple[dict[str, torch.Tensor], LaunchSizes]:
        """Tensors of ``batch`` with segmentation ``seg``, and the batch's own launch sizes."""
        sizes = LaunchSizes(batch.bs, batch.num_tokens, self.max_loras, seg.num_segments, seg.max_len,
                            seg.permutation is not None)
        lists = host_lists(batch, seg)
        dev, L = self.device, self.max_loras
        staged = _staged_int_fields(self.mapper)
        self._int = self._grown(self._int, sum(sizes.length(k) for _, k, _ in staged) + L, I32, dev)
        t: dict[str, torch.Tensor] = {}
        idle = batch.forward_mode is ForwardMode.IDLE
        with self._int.batch() as stage:
            for name, kind, _ in staged:
                t[name] = torch.empty(sizes.length(kind), dtype=I32, device=dev)
                stage.copy(lists[name], t[name])
            if self.mapper is not None:
                t["moe.token_lora_mapping"] = torch.empty(sizes.tokens, dtype=I32, device=dev)
                t["moe.adapter_enabled"] = torch.empty(L, dtype=I32, device=dev)
                if idle:  # no token, no kernel: nothing is enabled
                    stage.copy([0] * L, t["moe.adapter_enabled"])
        if seg.permutation is not None:
            self._long = self._grown(self._long, sizes.tokens, I64, dev)
            t["permutation"] = torch.empty(sizes.tokens, dtype=I64, device=dev)
            with self._long.batch() as stage:
                stage.copy(seg.permutation, t["permutation"])
        t["scalings"] = torch.empty(L, dtype=F32, device=dev)
        with self._float.batch() as stage:
            stage.copy(list(batch.scalings), t["scalings"])
        if self.mapper is not None and not idle:
            _map_on_device(self.mapper, t, L, self.moe_fields)
        return t, sizes


@dataclass
class GraphFamily:
    """One graph family's static buffers (allocated once, at its launch sizes) and staging.

    Attributes:
        capacity: what a batch of the family may hold (from its ``init_*_graph`` call; a second
            call must repeat it; ``capacity.fallback_reason`` says why a batch does not fit).
        sizes: the launch sizes (host numbers of every info it returns).
        segmentation: the backend's segmentation of a batch in this family.
        mapper: the device token mapper, or None (token mapping staged from host lists).
        moe_fields: the (offsets, slots) fields the device mapper reads (:data:`PER_REQUEST`).
        buffers: field name → its static buffer.
    """

    capacity: FamilyCapacity
    sizes: LaunchSizes
    segmentation: Callable[[BatchSpec], Segmentation]
    mapper: TokenMapper | None = None
    moe_fields: tuple[str, str] = PER_REQUEST
    buffers: dict[str, StaticBuffer] = field(default_factory=dict)
    int_staging: PinnedStaging | None = None
    long_staging: PinnedStaging | None = None
    float_staging: PinnedStaging | None = None

    @classmethod
    def allocate(cls, capacity: FamilyCapacity, sizes: LaunchSizes, segmentation: Callable[[BatchSpec], Segmentation],
                 device: torch.device, mapper: TokenMapper | None = None,
                 moe_fields: tuple[str, str] = PER_REQUEST) -> GraphFamily:
        """The family's static buffers and staging, filled with their tail values."""
        fam = cls(capacity, sizes, segmentation, mapper, moe_fields)
        name = fam.name
        for field_name, kind, fill in INT_FIELDS + MAPPING_FIELDS:
            fam.buffers[field_name] = StaticBuffer(f"{name}.{field_name}", sizes.length(kind), dtype=I32,
                                                   device=device, fill=fill)
        total = sum(sizes.length(kind) for _, kind, _ in _staged_int_fields(mapper))
        fam.buffers["scalings"] = StaticBuffer(f"{name}.scalings", sizes.slots, dtype=F32, device=device, fill=0.0)
        fam.int_staging = PinnedStaging(total, I32, device)
        fam.float_staging = PinnedStaging(sizes.slots, F32, device)
        if sizes.permuted:
            fam.buffers["permutation"] = StaticBuffer(f"{name}.permutation", sizes.tokens, dtype=I64, device=device,
                                                      fill=0)
            fam.long_staging = PinnedStaging(sizes.tokens, I64, device)
        return fam

    @property
    def name(self) -> str:
        """The family's name: "decode" or "prefill"."""
        return self.capacity.family

    def write(self, batch: BatchSpec, seg: Segmentation, max_loras: int) -> dict[str, torch.Tensor]:
        """Write ``batch`` into the static buffers in place, tails reset; returns the buffers' tensors.

        Raises:
            InvalidFieldError: the segmentation exceeds the family's segment capacity (a backend
                bug: its capacity bound is wrong). Checked before any write.
        """
        if seg.num_segments > self.sizes.segments or seg.max_len > self.sizes.max_len:
            raise InvalidFieldError(f"{self.name}.segments", f"{seg.num_segments} segments (longest {seg.max_len}) "
                                                             f"exceed the family's {self.sizes.segments} "
                                                             f"(max_len {self.sizes.max_len})")
        lists = host_lists(batch, seg)
        last = batch.num_tokens
        buf = self.buffers
        with self.int_staging.batch() as stage:
            for name, kind, _ in _staged_int_fields(self.mapper):
                # Offsets past the live entries repeat the last live offset: empty segments/requests.
                buf[name].write(lists[name], tail_fill=last if kind.endswith("+1") else None, stage=stage)
        if seg.permutation is not None:
            # Pad rows map to themselves: a permuted launch past the live tokens reads pad rows,
            # whose token mapping is -1.
            tail = list(range(last, self.sizes.tokens))
            with self.long_staging.batch() as stage:
                buf["permutation"].write(seg.permutation + tail, stage=stage)
        with self.float_staging.batch() as stage:
            buf["scalings"].write(list(batch.scalings), stage=stage)
        t = {name: b.tensor for name, b in buf.items()}
        if self.mapper is not None:
            _map_on_device(self.mapper, t, max_loras, self.moe_fields)
        return t
