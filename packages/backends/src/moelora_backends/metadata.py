"""Batch metadata of the kernel backends: host lists → device tensors, eagerly or into a graph
family's static buffers (DESIGN.md §3, §5).

Shared by ``triton`` and ``csgmv``; they differ only in the dense segmentation they hand in (a
:class:`~moelora_backends.segmentation.Segmentation` and, in graph mode, its capacities).

What ``prepare`` writes, and from where:

- from the ``BatchSpec``'s host lists, through pinned double-buffered staging (``PinnedStaging``,
  ``non_blocking`` copies): the segmentation (``seg_indptr``, ``seg_lens``, ``weight_indices``,
  ``permutation``), the per-request fields (``req_seg_indptr``, ``req_weight_indices``, which the
  MoE fields ``moe.seg_indptr`` / ``moe.req_to_lora`` are: per request, whatever the dense
  segmentation), ``lora_ranks`` and ``scalings``;
- on the device, by ``moelora_kernels.token_lora_mapping`` from the per-request fields: the MoE
  token mapping ``moe.token_lora_mapping`` and ``moe.adapter_enabled`` (one launch; an eager IDLE
  batch launches nothing and stages ``adapter_enabled`` as zeros).

Eager (``family=None``): fresh tensors sized to the batch. Graph families: :class:`GraphFamily`
owns one set of :class:`~moelora_core.StaticBuffer` per family (decode and prefill share no storage),
sized from the family's capacities at init; every batch writes them in place and resets the tails
(offsets to the last live offset, slots and token mappings to -1, lengths to 0, permutation tails
to the pad rows themselves). A batch over capacity gets a ``Fallback`` before anything is written.
No device value is read on the host anywhere here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelora_backends.segmentation import Segmentation
from moelora_core.backend_checks import FamilyCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo, MoELoRABatchInfo
from moelora_core.errors import InvalidFieldError
from moelora_core.forward_mode import ForwardMode
from moelora_core.staging import PinnedStaging
from moelora_core.static_buffer import StaticBuffer
from moelora_kernels import token_lora_mapping

I32, I64, F32 = torch.int32, torch.int64, torch.float32

#: int32 fields staged per batch: (name, length kind, tail fill). Kinds: "seg+1" segment offsets,
#: "seg" per segment, "req+1" request offsets, "req" per request, "slots" per slot.
INT_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("seg_indptr", "seg+1", 0),
    ("seg_lens", "seg", 0),
    ("weight_indices", "seg", -1),
    ("req_seg_indptr", "req+1", 0),
    ("req_weight_indices", "req", -1),
    ("lora_ranks", "slots", 0),
)
#: Written on the device by the token-mapping kernel: (name, length kind, fill).
KERNEL_FIELDS: tuple[tuple[str, str, int], ...] = (("token_lora_mapping", "tok", -1), ("adapter_enabled", "slots", 0))


@dataclass(frozen=True)
class Capacity:
    """Sizes of one set of metadata tensors (a graph family's capacities, or an eager batch).

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
        return {"seg+1": self.segments + 1, "seg": self.segments, "req+1": self.requests + 1, "req": self.requests,
                "slots": self.slots, "tok": self.tokens}[kind]


def _host_lists(batch: BatchSpec, seg: Segmentation) -> dict[str, list]:
    return {
        "seg_indptr": seg.seg_indptr,
        "seg_lens": seg.seg_lens,
        "weight_indices": seg.weight_indices,
        "req_seg_indptr": list(batch.req_seg_indptr),
        "req_weight_indices": list(batch.req_to_lora),
        "lora_ranks": list(batch.lora_ranks),
    }


#: The fields the MoE path reads as (offsets, slots) of its requests: the per-request ones, whatever
#: the dense segmentation (csgmv chunks are not requests: sgl-project/sglang#24007).
PER_REQUEST: tuple[str, str] = ("req_seg_indptr", "req_weight_indices")


def map_tokens(t: dict[str, torch.Tensor], max_loras: int, moe_fields: tuple[str, str] = PER_REQUEST) -> None:
    """``moe.token_lora_mapping`` and ``moe.adapter_enabled`` from the MoE's per-request fields, on
    the device, into ``t``'s tensors (one kernel launch; tails past the live tokens become -1)."""
    indptr, slots = moe_fields
    token_lora_mapping(t[indptr], t[slots], max_loras=max_loras, mapping_out=t["token_lora_mapping"],
                       adapter_enabled_out=t["adapter_enabled"])


def build_info(batch: BatchSpec, t: dict[str, torch.Tensor], cap: Capacity, *, num_experts: int, max_loras: int,
               has_active_lora: bool, use_cuda_graph: bool,
               moe_fields: tuple[str, str] = PER_REQUEST) -> LoRABatchInfo:
    """The ``LoRABatchInfo`` over tensors ``t`` with the host numbers of ``cap``.

    The MoE per-request fields are the per-request tensors themselves (same values by contract).
    """
    moe = MoELoRABatchInfo(seg_indptr=t[moe_fields[0]], req_to_lora=t[moe_fields[1]],
                           adapter_enabled=t["adapter_enabled"], token_lora_mapping=t["token_lora_mapping"],
                           num_experts=num_experts, max_loras=max_loras)
    return LoRABatchInfo(
        forward_mode=batch.forward_mode, bs=cap.requests, num_tokens=cap.tokens, num_segments=cap.segments,
        max_len=cap.max_len, seg_indptr=t["seg_indptr"], seg_lens=t["seg_lens"], weight_indices=t["weight_indices"],
        lora_ranks=t["lora_ranks"], scalings=t["scalings"], permutation=t.get("permutation"),
        req_seg_indptr=t["req_seg_indptr"], req_weight_indices=t["req_weight_indices"],
        has_active_lora=has_active_lora, use_cuda_graph=use_cuda_graph, moe=moe,
    )


class EagerMetadata:
    """Fresh metadata tensors per batch, staged through growable pinned buffers.

    Args:
        device: where the tensors live. max_loras: slots of the pool.
    """

    def __init__(self, device: torch.device, max_loras: int) -> None:
        self.device = device
        self.max_loras = max_loras
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

    def write(self, batch: BatchSpec, seg: Segmentation,
              moe_fields: tuple[str, str] = PER_REQUEST) -> tuple[dict[str, torch.Tensor], Capacity]:
        """Tensors of ``batch`` with segmentation ``seg`` and the batch's own sizes."""
        cap = Capacity(batch.bs, batch.num_tokens, self.max_loras, seg.num_segments, seg.max_len,
                       seg.permutation is not None)
        lists = _host_lists(batch, seg)
        dev, L = self.device, self.max_loras
        self._int = self._grown(self._int, sum(cap.length(k) for _, k, _ in INT_FIELDS) + L, I32, dev)
        t: dict[str, torch.Tensor] = {}
        idle = batch.forward_mode is ForwardMode.IDLE
        with self._int.batch() as stage:
            for name, kind, _ in INT_FIELDS:
                t[name] = torch.empty(cap.length(kind), dtype=I32, device=dev)
                stage.copy(lists[name], t[name])
            t["token_lora_mapping"] = torch.empty(cap.tokens, dtype=I32, device=dev)
            t["adapter_enabled"] = torch.empty(L, dtype=I32, device=dev)
            if idle:  # no token, no kernel: nothing is enabled
                stage.copy([0] * L, t["adapter_enabled"])
        if seg.permutation is not None:
            self._long = self._grown(self._long, cap.tokens, I64, dev)
            t["permutation"] = torch.empty(cap.tokens, dtype=I64, device=dev)
            with self._long.batch() as stage:
                stage.copy(seg.permutation, t["permutation"])
        t["scalings"] = torch.empty(L, dtype=F32, device=dev)
        with self._float.batch() as stage:
            stage.copy(list(batch.scalings), t["scalings"])
        if not idle:
            map_tokens(t, L, moe_fields)
        return t, cap


@dataclass
class GraphFamily:
    """One graph family's static buffers (allocated once, at its capacities) and staging.

    Attributes:
        capacity: what a batch of the family may hold (from its ``init_*_graph`` call; a second
            call must repeat it; ``capacity.fallback_reason`` says why a batch does not fit).
        cap: the launch sizes (host numbers of every info it returns).
        segmentation: the backend's segmentation of a batch in this family.
    """

    capacity: FamilyCapacity
    cap: Capacity
    segmentation: Callable[[BatchSpec], Segmentation]
    buffers: dict[str, StaticBuffer] = field(default_factory=dict)
    int_staging: PinnedStaging | None = None
    long_staging: PinnedStaging | None = None
    float_staging: PinnedStaging | None = None

    @classmethod
    def allocate(cls, capacity: FamilyCapacity, cap: Capacity, segmentation: Callable[[BatchSpec], Segmentation],
                 device: torch.device) -> GraphFamily:
        fam = cls(capacity, cap, segmentation)
        name = fam.name
        for field_name, kind, fill in INT_FIELDS + KERNEL_FIELDS:
            fam.buffers[field_name] = StaticBuffer(f"{name}.{field_name}", cap.length(kind), dtype=I32,
                                                   device=device, fill=fill)
        total = sum(cap.length(kind) for _, kind, _ in INT_FIELDS)
        fam.buffers["scalings"] = StaticBuffer(f"{name}.scalings", cap.slots, dtype=F32, device=device, fill=0.0)
        fam.int_staging = PinnedStaging(total, I32, device)
        fam.float_staging = PinnedStaging(cap.slots, F32, device)
        if cap.permuted:
            fam.buffers["permutation"] = StaticBuffer(f"{name}.permutation", cap.tokens, dtype=I64, device=device,
                                                      fill=0)
            fam.long_staging = PinnedStaging(cap.tokens, I64, device)
        return fam

    @property
    def name(self) -> str:
        """The family's name: "decode" or "prefill"."""
        return self.capacity.family

    def write(self, batch: BatchSpec, seg: Segmentation, max_loras: int,
              moe_fields: tuple[str, str] = PER_REQUEST) -> dict[str, torch.Tensor]:
        """Write ``batch`` into the static buffers in place, tails reset; returns the buffers.

        Raises:
            InvalidFieldError: the segmentation exceeds the family's segment capacity (a backend
                bug: its capacity bound is wrong). Checked before any write.
        """
        if seg.num_segments > self.cap.segments or seg.max_len > self.cap.max_len:
            raise InvalidFieldError(f"{self.name}.segments", f"{seg.num_segments} segments (longest {seg.max_len}) "
                                                             f"exceed the family's {self.cap.segments} "
                                                             f"(max_len {self.cap.max_len})")
        lists = _host_lists(batch, seg)
        last = batch.num_tokens
        buf = self.buffers
        with self.int_staging.batch() as stage:
            for name, kind, _ in INT_FIELDS:
                # Offsets past the live entries repeat the last live offset: empty segments/requests.
                buf[name].write(lists[name], tail_fill=last if kind.endswith("+1") else None, stage=stage)
        if seg.permutation is not None:
            # Pad rows map to themselves: a permuted launch past the live tokens reads pad rows,
            # whose token mapping is -1.
            tail = list(range(last, self.cap.tokens))
            with self.long_staging.batch() as stage:
                buf["permutation"].write(seg.permutation + tail, stage=stage)
        with self.float_staging.batch() as stage:
            buf["scalings"].write(list(batch.scalings), stage=stage)
        t = {name: b.tensor for name, b in buf.items()}
        map_tokens(t, max_loras, moe_fields)
        return t
