"""The batch-metadata machinery of every built-in backend: host lists → device tensors, eagerly or
into a graph family's static buffers (DESIGN.md §3, §5, §6).

One machinery, used by ``triton``, ``csgmv`` (``moelora_backends``) and ``reference``
(``moelora_reference``) through :class:`moelora_core.backend_base.BackendBase`; backends differ only
in the dense :class:`Segmentation` they hand in (and its :class:`LaunchSizes` in graph mode) and in
the device function that writes the token map (:data:`TokenMapper`):

- staged from the ``BatchSpec``'s host lists, through pinned double-buffered staging
  (``PinnedStaging``, ``non_blocking`` copies), once per batch: the request segments
  (``req_seg_indptr``, ``req_weight_indices``) and, where the backend's segmentation is not one
  segment per request, the backend segments (``seg_indptr``, ``weight_indices``, ``permutation``);
  a segmentation by request stages nothing more: its segments are the request tensors;
- written on the device from the request segments by the backend's :data:`TokenMapper` (the kernel
  backends: one Triton launch; the default, :func:`map_tokens_torch`: a few torch ops): the token map
  ``token_lora_mapping`` and ``adapter_enabled``. The map is built once per batch, where the
  kernels read it; the host never builds it. An eager IDLE batch launches nothing
  (``adapter_enabled`` is zeroed);
- never per batch: ranks and σ, which the kernels read from the pool (``LoRAWeights``).

Eager (``family=None``, :class:`EagerMetadata`): fresh tensors sized to the batch. Graph families
(:class:`GraphFamily`): one set of :class:`~moelora_core.StaticBuffer` per family (decode and prefill
share no storage), allocated once at the family's capacity (its largest bucket). A batch prepared
for a bucket writes the views ``[:n]`` of those buffers that the bucket's launch sizes give, in place,
and resets the tails of those views (offsets to the last live offset, slots and the token map to -1,
permutation tails to the pad rows themselves): every bucket's graph reads the same memory, so a
small bucket replayed after a larger batch reads what its own prepare wrote, nothing else. A batch
over capacity gets a ``Fallback`` before anything is written
(:meth:`moelora_core.backend_checks.GraphCapacity.fallback_reason`). No device value is read on the
host anywhere here.

Names: a graph family's buffers are keyed by the info's field names (``"req_seg_indptr"``, ...,
``"token_lora_mapping"``, ``"adapter_enabled"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.errors import InvalidFieldError
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER
from moelora_core.staging import PinnedStaging
from moelora_core.static_buffer import StaticBuffer

I32, I64 = torch.int32, torch.int64

#: The request segments, staged from host lists per batch: (name, length kind, tail fill). Kinds:
#: "req+1" request offsets, "req" per request, "seg+1" segment offsets, "seg" per segment, "slots" per
#: slot, "tok" per token. An offsets field's tail is the last live offset (empty segments).
REQUEST_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("req_seg_indptr", "req+1", 0),
    ("req_weight_indices", "req", NO_ADAPTER),
)
#: The backend segments, staged per batch unless the backend segments by request (then they are the
#: request tensors themselves).
SEGMENT_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("seg_indptr", "seg+1", 0),
    ("weight_indices", "seg", NO_ADAPTER),
)
#: Written on the device by the :data:`TokenMapper` from the request segments.
MAPPING_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("token_lora_mapping", "tok", NO_ADAPTER),
    ("adapter_enabled", "slots", 0),
)
#: The (offsets, slots) fields the token mapper reads: the request segments, whatever the dense
#: segmentation (csgmv chunks are not requests: sgl-project/sglang#24007).
PER_REQUEST: tuple[str, str] = ("req_seg_indptr", "req_weight_indices")

#: ``mapper(req_seg_indptr [bs+1], req_weight_indices [bs], max_loras, mapping_out [tokens],
#: enabled_out [L])``: writes the token map on the device (tails past the live tokens -1), e.g.
#: ``moelora_kernels.token_lora_mapping`` or :func:`map_tokens_torch`.
TokenMapper = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], None]


def map_tokens_torch(req_seg_indptr: torch.Tensor, req_weight_indices: torch.Tensor, max_loras: int,
                     mapping_out: torch.Tensor, enabled_out: torch.Tensor) -> None:
    """The token map in torch ops on the device (the :data:`TokenMapper` of backends without a kernel
    for it): ``mapping_out[t]`` = the slot of the request whose segment holds row t, -1 past the last
    live offset; ``enabled_out[s]`` = 1 where a request with at least one token uses slot s.

    The same rule as the Triton mapping kernel (``moelora_kernels.token_lora_mapping``; readable twin
    ``moelora_reference.mapping.token_lora_mapping``): row t belongs to the largest r with
    ``req_seg_indptr[r] <= t``. Fixed shapes (host numbers) and device ops only: graph-safe, no host
    sync.

    Args:
        req_seg_indptr: [bs + 1] int32, non-decreasing from 0 (graph tails = the last live offset).
        req_weight_indices: [bs] int32 slots, -1 = none. max_loras: L.
        mapping_out: [T] int32, written whole. enabled_out: [L] int32, written whole.
    """
    bs, rows = req_weight_indices.numel(), mapping_out.numel()
    if bs == 0 or rows == 0:  # host shapes: no request or no row
        mapping_out.fill_(NO_ADAPTER)
        enabled_out.zero_()
        return
    t = torch.arange(rows, dtype=req_seg_indptr.dtype, device=mapping_out.device)
    request = torch.searchsorted(req_seg_indptr[1:], t, right=True)  # [T] int64; bs = past the last offset
    slot = req_weight_indices[request.clamp(max=bs - 1)]
    mapping_out.copy_(torch.where(request < bs, slot, torch.full_like(slot, NO_ADAPTER)))
    has_tokens = (req_seg_indptr[1:] > req_seg_indptr[:-1])[:, None]  # [bs, 1]
    slots = torch.arange(max_loras, dtype=req_weight_indices.dtype, device=enabled_out.device)
    enabled_out.copy_(((req_weight_indices[:, None] == slots[None, :]) & has_tokens).any(0).to(enabled_out.dtype))


@dataclass(frozen=True)
class Segmentation:
    """A dense segmentation of a batch as host lists (DESIGN.md §3).

    Attributes:
        seg_indptr: [S + 1] token offsets of the segments (permuted order if ``permutation``).
        weight_indices: [S] slot per segment, ``NO_ADAPTER`` for base tokens.
        permutation: [N] original row at each sorted position, or None (batch order).
        of_requests: the segments are the requests (built by :meth:`per_request`): the info's backend
            segments are then the request tensors themselves, staged once.
    """

    seg_indptr: list[int]
    weight_indices: list[int]
    permutation: list[int] | None
    of_requests: bool = False

    @classmethod
    def per_request(cls, batch: BatchSpec) -> Segmentation:
        """One segment per request in batch order: ``seg_indptr = req_seg_indptr``, slots per request."""
        return cls(list(batch.req_seg_indptr), list(batch.req_weight_indices), None, True)

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
    a graph bucket's (fixed at capture, from its :class:`GraphCapacity`; a family's buffers are
    allocated at its largest bucket's) or an eager batch's own.

    Attributes:
        requests, tokens, slots: per-request, per-token and per-slot lengths.
        segments: S, segments of the dense launch. max_len: longest segment (a launch bound).
        permuted: whether the segmentation carries a token permutation.
        request_segments: the backend segments are the requests (no tensors of their own).
    """

    requests: int
    tokens: int
    slots: int
    segments: int
    max_len: int
    permuted: bool
    request_segments: bool = False

    def length(self, kind: str) -> int:
        """Elements of a field of length ``kind`` (see :data:`REQUEST_FIELDS`)."""
        return {"seg+1": self.segments + 1, "seg": self.segments, "req+1": self.requests + 1, "req": self.requests,
                "slots": self.slots, "tok": self.tokens}[kind]

    def within(self, other: LaunchSizes) -> bool:
        """Whether tensors of these sizes are views of ``other``'s (a bucket within its family)."""
        return (self.requests <= other.requests and self.tokens <= other.tokens and self.slots == other.slots
                and self.segments <= other.segments and self.max_len <= other.max_len
                and self.permuted == other.permuted and self.request_segments == other.request_segments)


def staged_fields(request_segments: bool) -> tuple[tuple[str, str, int], ...]:
    """The int32 fields staged from host lists: the request segments, and the backend segments unless
    they are the requests."""
    return REQUEST_FIELDS if request_segments else REQUEST_FIELDS + SEGMENT_FIELDS


def host_lists(batch: BatchSpec, seg: Segmentation) -> dict[str, list]:
    """Every int32 field staged for ``batch`` with segmentation ``seg`` (live entries only)."""
    lists = {"req_seg_indptr": list(batch.req_seg_indptr), "req_weight_indices": list(batch.req_weight_indices)}
    if not seg.of_requests:
        lists.update(seg_indptr=seg.seg_indptr, weight_indices=seg.weight_indices)
    return lists


def _map_on_device(mapper: TokenMapper, t: dict[str, torch.Tensor], max_loras: int,
                   mapping_fields: tuple[str, str]) -> None:
    indptr, slots = mapping_fields
    mapper(t[indptr], t[slots], max_loras, t["token_lora_mapping"], t["adapter_enabled"])


def _alias_request_segments(t: dict[str, torch.Tensor]) -> None:
    t["seg_indptr"], t["weight_indices"] = t["req_seg_indptr"], t["req_weight_indices"]


def build_info(t: dict[str, torch.Tensor], sizes: LaunchSizes, *, has_active_lora: bool,
               use_cuda_graph: bool) -> LoRABatchInfo:
    """The ``LoRABatchInfo`` over tensors ``t`` (field name → tensor) with the host numbers of ``sizes``."""
    return LoRABatchInfo(
        num_tokens=sizes.tokens, req_seg_indptr=t["req_seg_indptr"], req_weight_indices=t["req_weight_indices"],
        token_lora_mapping=t["token_lora_mapping"], adapter_enabled=t["adapter_enabled"],
        num_segments=sizes.segments, max_len=sizes.max_len, seg_indptr=t["seg_indptr"],
        weight_indices=t["weight_indices"], permutation=t.get("permutation"), has_active_lora=has_active_lora,
        use_cuda_graph=use_cuda_graph,
    )


class EagerMetadata:
    """Fresh metadata tensors per batch, staged through growable pinned buffers.

    Args:
        device: where the tensors live. max_loras: slots of the pool.
        mapper: writes the token map on the device.
        mapping_fields: the (offsets, slots) fields the mapper reads (:data:`PER_REQUEST`).
    """

    def __init__(self, device: torch.device, max_loras: int, mapper: TokenMapper = map_tokens_torch,
                 mapping_fields: tuple[str, str] = PER_REQUEST) -> None:
        self.device = device
        self.max_loras = max_loras
        self.mapper = mapper
        self.mapping_fields = mapping_fields
        self._int = PinnedStaging(0, I32, device)
        self._long = PinnedStaging(0, I64, device)

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
                            seg.permutation is not None, seg.of_requests)
        lists = host_lists(batch, seg)
        dev, L = self.device, self.max_loras
        staged = staged_fields(seg.of_requests)
        self._int = self._grown(self._int, sum(sizes.length(k) for _, k, _ in staged), I32, dev)
        t: dict[str, torch.Tensor] = {}
        with self._int.batch() as stage:
            for name, kind, _ in staged:
                t[name] = torch.empty(sizes.length(kind), dtype=I32, device=dev)
                stage.copy(lists[name], t[name])
        if seg.of_requests:
            _alias_request_segments(t)
        if seg.permutation is not None:
            self._long = self._grown(self._long, sizes.tokens, I64, dev)
            t["permutation"] = torch.empty(sizes.tokens, dtype=I64, device=dev)
            with self._long.batch() as stage:
                stage.copy(seg.permutation, t["permutation"])
        t["token_lora_mapping"] = torch.empty(sizes.tokens, dtype=I32, device=dev)
        t["adapter_enabled"] = torch.empty(L, dtype=I32, device=dev)
        if batch.forward_mode is ForwardMode.IDLE:  # no token, no kernel: nothing is enabled
            t["adapter_enabled"].zero_()
        else:
            _map_on_device(self.mapper, t, L, self.mapping_fields)
        return t, sizes


@dataclass
class GraphFamily:
    """One graph family's static buffers (allocated once, at the family's capacity: its largest
    bucket) and staging, and the launch sizes of each bucket prepared in it.

    Attributes:
        name: "decode" or "prefill".
        capacity: what a batch of the family may hold (from its ``init_graph`` call; a second call must
            repeat it).
        sizes: the launch sizes at that capacity: the buffers' lengths.
        segmentation: the backend's segmentation of a batch at the family's capacity.
        mapper: the device token mapper. mapping_fields: the (offsets, slots) fields it reads.
        buffers: field name → its static buffer.
        buckets: bucket capacity → (its launch sizes, its segmentation function), filled by the backend
            on a bucket's first prepare.
    """

    name: str
    capacity: GraphCapacity
    sizes: LaunchSizes
    segmentation: Callable[[BatchSpec], Segmentation]
    mapper: TokenMapper = map_tokens_torch
    mapping_fields: tuple[str, str] = PER_REQUEST
    buffers: dict[str, StaticBuffer] = field(default_factory=dict)
    buckets: dict[GraphCapacity, tuple[LaunchSizes, Callable[[BatchSpec], Segmentation]]] = field(
        default_factory=dict)
    int_staging: PinnedStaging | None = None
    long_staging: PinnedStaging | None = None

    @classmethod
    def allocate(cls, name: str, capacity: GraphCapacity, sizes: LaunchSizes,
                 segmentation: Callable[[BatchSpec], Segmentation], device: torch.device,
                 mapper: TokenMapper = map_tokens_torch,
                 mapping_fields: tuple[str, str] = PER_REQUEST) -> GraphFamily:
        """The family's static buffers and staging, filled with their tail values."""
        fam = cls(name, capacity, sizes, segmentation, mapper, mapping_fields)
        fam.buckets[capacity] = (sizes, segmentation)
        staged = staged_fields(sizes.request_segments)
        for field_name, kind, fill in staged + MAPPING_FIELDS:
            fam.buffers[field_name] = StaticBuffer(f"{name}.{field_name}", sizes.length(kind), dtype=I32,
                                                   device=device, fill=fill)
        fam.int_staging = PinnedStaging(sum(sizes.length(kind) for _, kind, _ in staged), I32, device)
        if sizes.permuted:
            fam.buffers["permutation"] = StaticBuffer(f"{name}.permutation", sizes.tokens, dtype=I64, device=device,
                                                      fill=0)
            fam.long_staging = PinnedStaging(sizes.tokens, I64, device)
        return fam

    def tensors(self) -> dict[str, torch.Tensor]:
        """The whole buffers by field name, the backend segments included (the request buffers where
        the family segments by request)."""
        t = {name: b.tensor for name, b in self.buffers.items()}
        if self.sizes.request_segments:
            _alias_request_segments(t)
        return t

    def write(self, batch: BatchSpec, seg: Segmentation, sizes: LaunchSizes) -> dict[str, torch.Tensor]:
        """Write ``batch`` into the views of the static buffers that ``sizes`` (a bucket's launch sizes,
        within the family's) give, in place, their tails reset; returns those views.

        Raises:
            InvalidFieldError: the segmentation exceeds the bucket's segment capacity, or ``sizes`` are
                not within the family's buffers (a backend bug: its capacity bound is wrong). Checked
                before any write.
        """
        if not sizes.within(self.sizes):
            raise InvalidFieldError(f"{self.name}.bucket", f"launch sizes {sizes} are not within the family's "
                                                           f"buffers {self.sizes}")
        if (seg.num_segments > sizes.segments or seg.max_len > sizes.max_len
                or seg.of_requests != sizes.request_segments):
            raise InvalidFieldError(f"{self.name}.segments", f"{seg.num_segments} segments (longest {seg.max_len}) "
                                                             f"exceed the bucket's {sizes.segments} (max_len "
                                                             f"{sizes.max_len}) or are not of its kind")
        lists = host_lists(batch, seg)
        last = batch.num_tokens
        buf = self.buffers
        t: dict[str, torch.Tensor] = {}
        with self.int_staging.batch() as stage:
            for name, kind, _ in staged_fields(sizes.request_segments):
                # Offsets past the live entries repeat the last live offset: empty segments/requests.
                t[name] = buf[name].write(lists[name], rows=sizes.length(kind),
                                          tail_fill=last if kind.endswith("+1") else None, stage=stage)
        if sizes.request_segments:
            _alias_request_segments(t)
        if seg.permutation is not None:
            # Pad rows map to themselves: a permuted launch past the live tokens reads pad rows,
            # whose token map is -1.
            tail = list(range(last, sizes.tokens))
            with self.long_staging.batch() as stage:
                t["permutation"] = buf["permutation"].write(seg.permutation + tail, rows=sizes.tokens, stage=stage)
        t["token_lora_mapping"] = buf["token_lora_mapping"].view(sizes.tokens)
        t["adapter_enabled"] = buf["adapter_enabled"].view(sizes.slots)
        _map_on_device(self.mapper, t, sizes.slots, self.mapping_fields)
        return t
