"""The graph runners of DESIGN.md §6: whole forwards captured once per bucket, replayed with live
LoRA metadata written in place.

A :class:`GraphBucket` is one captured size of one family:

- its **own backend instance**, built by the engine's backend factory, with that family initialised
  at the bucket's capacity (``init_decode_graph(bs)`` / ``init_prefill_graph(tokens, requests)``):
  every bucket and every family owns separate LoRA/MoE scratch by construction, and graph mode's
  host numbers (grids, segment counts) are that capacity. All instances read the same adapter pools
  (``LoRAWeights`` per layer) and hear of every slot load (``AdapterPool.attach_backend``);
- its :class:`~moelora_runner.forward_batch.StaticForwardBatch` (tokens, positions, KV locations at
  capacity; attention's key width fixed to the KV table's width);
- its captured graph(s), in one :class:`~moelora_core.graphs.GraphPool` per family (on CUDA one
  memory pool shared by the family's buckets):

  - ``full`` (the decode graph and prefill ``full``): one graph of
    :meth:`~moelora_runner.model.MoEDecoder.hidden_states` — embed, every layer, attention included
    (attention reads the static batch: graph-safe);
  - ``breakable`` (prefill): L + 1 graphs, the segments between attention calls (embed + layer 0
    pre-attention; post-attention(i) + pre-attention(i + 1); the last post-attention). Attention
    runs eagerly between replays on the step's **live, unpadded** metadata (its own rows, its own
    longest context): it writes the live rows' K/V and attends over them, and its output is copied
    into the next segment's static input (pad rows zeroed). The LoRA and MoE work is inside the
    segments.

The graph's output is the final hidden states of the bucket's rows; the LM head runs after the replay
on the step's ``logits_indices`` rows (a [tokens × vocab] tensor inside a graph would be wasted at
real vocabulary sizes).

Capture runs on an IDLE batch written into the static buffers (every row a pad row, every request
slot empty), so nothing of a real batch is frozen into the graph; the backend's ``prepare`` must
answer it with ``has_active_lora`` True (the LoRA kernels are recorded and exit early on the device
for unused slots) or the capture is refused (:class:`~moelora_runner.errors.GraphCaptureError`). The
addresses of the info's device tensors are recorded then and checked at every later ``prepare``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode
from moelora_core.graphs import CapturedGraph, GraphPool
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.errors import GraphCaptureError
from moelora_runner.forward_batch import ForwardBatch, ForwardBatchHost, ForwardBatchStager, StaticForwardBatch
from moelora_runner.kv_cache import NULL_LOCATION, KVCache
from moelora_runner.model import LoRAContext, MoEDecoder

#: Eager-fallback reasons (``moelora_forward_passes_total{reason}``); graph passes carry "".
REASONS = {
    "disabled": "no graph runs this phase (eager mode, or the decode graph is off)",
    "over_tokens": "more tokens than the largest token bucket",
    "over_requests": "more requests than the graph's request slots (decode: the largest batch bucket)",
    "backend_fallback": "the backend's prepare answered Fallback for the bucket's family",
}


def _tensor_addresses(info: LoRABatchInfo) -> dict[str, int]:
    out = {name: t.data_ptr() for name, t in info.device_tensors().items()}
    out.update({f"private.{k}": v.data_ptr() for k, v in info.private.items() if isinstance(v, torch.Tensor)})
    return out


def empty_host(adapters: AdapterPool) -> ForwardBatchHost:
    """An IDLE step (no token, no request): what a bucket is captured on."""
    spec = BatchSpec(ForwardMode.IDLE, [], adapters.max_loras, adapters.slot_ranks(), adapters.slot_scalings())
    return ForwardBatchHost(spec, (), (), (), (), (), (), ())


class GraphBucket:
    """One captured size of one graph family (module doc).

    Args:
        family: "decode" or "prefill". mode: "full" or "breakable" (decode: "full").
        tokens, requests: the bucket's token and request capacity (decode: both the batch size).
        backend: this bucket's own backend instance (fresh from the factory).
        model, kv, adapters: the engine's. pool: the family's graph pool.

    Raises:
        InvalidFieldError: the backend refuses the family's capacities.
    """

    def __init__(self, *, family: str, mode: str, tokens: int, requests: int, backend: object, model: MoEDecoder,
                 kv: KVCache, adapters: AdapterPool, pool: GraphPool) -> None:
        self.family, self.mode = family, mode
        self.tokens, self.requests = tokens, requests
        self.backend = backend
        self.model, self.kv, self.pool = model, kv, pool
        if family == "decode":
            backend.init_decode_graph(requests)
        else:
            backend.init_prefill_graph(tokens, requests)
        self.static = StaticForwardBatch(max_tokens=tokens, max_requests=requests, max_context=kv.max_context,
                                         null_location=NULL_LOCATION, padding_row=kv.padding_row, device=pool.device)
        self.lora = LoRAContext(backend, adapters.pools)
        self.graphs: list[CapturedGraph] = []
        self.capture_info: LoRABatchInfo | None = None
        self._addresses: dict[str, int] = {}
        self._attn_in: torch.Tensor | None = None
        # Warm-up is for CUDA (lazy initialisation, Triton compilation and autotuning outside the
        # capture); the emulator's capture runs the callable itself, so a warm-up call would only
        # repeat it.
        self._warmup = 1 if pool.kind == "cuda" else 0

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _name(self) -> str:
        return f"{self.family} bucket {self.tokens} tokens / {self.requests} requests"

    def prepare(self, spec: BatchSpec) -> LoRABatchInfo | Fallback:
        """The backend's ``prepare(spec, family)`` (writes its static buffers in place).

        Raises:
            GraphCaptureError: the info's device tensors are not the ones captured.
        """
        info = self.backend.prepare(spec, family=self.family)
        if isinstance(info, Fallback) or not self._addresses:
            return info
        moved = sorted(k for k, p in _tensor_addresses(info).items() if self._addresses.get(k) != p)
        if moved:
            raise GraphCaptureError(f"{self._name()}: backend {self.backend.name!r} returned device tensors other "
                                    f"than the captured ones for {moved}; graph-mode metadata must be written in "
                                    "place into the family's static buffers")
        return info

    # --- capture -------------------------------------------------------------------------------

    def capture(self, idle: ForwardBatchHost, stager: ForwardBatchStager) -> None:
        """Capture the bucket on the IDLE step ``idle`` (module doc). Capture does no work.

        Raises:
            GraphCaptureError: the backend answered the capture batch with ``Fallback`` or with
                ``has_active_lora`` False.
            HostSyncError: a host sync in a captured callable.
        """
        info = self.backend.prepare(idle.batch_spec, family=self.family)
        if isinstance(info, Fallback):
            raise GraphCaptureError(f"{self._name()}: backend {self.backend.name!r} answered the capture batch with "
                                    f"Fallback({info.reason!r})")
        if not info.has_active_lora:
            raise GraphCaptureError(f"{self._name()}: backend {self.backend.name!r} prepared the capture batch with "
                                    "has_active_lora False: the LoRA kernels would not be recorded and no replay "
                                    "would add a delta (DESIGN.md §3)")
        self.capture_info = info
        self._addresses = _tensor_addresses(info)
        self.static.write(idle)
        fb = self.static.forward_batch(info)
        if self.mode == "full":
            self.graphs = [self.pool.capture(lambda: self.model.hidden_states(fb, self.kv, self.lora),
                                            warmup=self._warmup)]
            return
        self._capture_segments(fb, stager.stage(idle, info))

    def _capture_segments(self, fb: ForwardBatch, live: ForwardBatch) -> None:
        model, lora = self.model, self.lora
        # The static input of every post-attention segment: the eager attention's output lands here.
        self._attn_in = torch.zeros(self.tokens, model.attention_width, dtype=model.dtype, device=self.pool.device)
        attn_in = self._attn_in

        def first():
            h = model.embed(fb)
            return (h, *model.pre_attention(0, h, fb, lora))

        def middle(i: int, h_in: torch.Tensor) -> Callable[[], tuple]:
            def segment():
                h = model.post_attention(i, attn_in, h_in, fb, lora)
                return (h, *model.pre_attention(i + 1, h, fb, lora))
            return segment

        def last(h_in: torch.Tensor) -> Callable[[], torch.Tensor]:
            return lambda: model.post_attention(model.num_layers - 1, attn_in, h_in, fb, lora)

        # In order, each segment replayed before the next is captured (on the IDLE batch): the next
        # one reads finite outputs at its warm-up, on CUDA as on the emulator.
        graphs = [self.pool.capture(first, warmup=self._warmup)]
        out = graphs[0].replay()
        for i in range(model.num_layers):
            self._attend(i, out, live)
            segment = middle(i, out[0]) if i + 1 < model.num_layers else last(out[0])
            graphs.append(self.pool.capture(segment, warmup=self._warmup))
            out = graphs[-1].replay()
        self.graphs = graphs

    # --- replay --------------------------------------------------------------------------------

    def _attend(self, i: int, out: tuple, live: ForwardBatch) -> None:
        """Layer ``i``'s attention eagerly on the live rows; its output into the static input."""
        _, q, k, v = out
        T = live.num_tokens
        attn = self.model.attention(i, q[:T], k[:T], v[:T], live, self.kv)
        self._attn_in[:T].copy_(attn)
        self._attn_in[T:].zero_()

    def replay(self, host: ForwardBatchHost, live: ForwardBatch) -> torch.Tensor:
        """Write ``host`` into the static batch and replay (the backend's buffers already prepared).

        Args:
            host: the step's lists (they fit the bucket). live: the step's own device tensors (the
                eager attention of ``breakable``; the caller's LM head).

        Returns:
            [tokens, H] final hidden states of the bucket's rows (the step's rows first).
        """
        self.static.write(host)
        if self.mode == "full":
            return self.graphs[0].replay()
        out = self.graphs[0].replay()
        for i in range(self.model.num_layers):
            self._attend(i, out, live)
            out = self.graphs[i + 1].replay()
        return out


@dataclass(frozen=True)
class BucketChoice:
    """Where a step runs in a family: a bucket size, or an eager-fallback reason with its detail."""

    size: int | None
    reason: str = ""
    detail: str = ""


class GraphRunner:
    """The buckets of one family, built and captured on first use or all at start-up.

    Args:
        family: "decode" (buckets by batch size) or "prefill" (buckets by tokens).
        mode: "full" or "breakable". sizes: the bucket sizes (ascending).
        request_slots: request capacity of the bucket of a size.
        make_backend: a fresh backend instance (the engine's factory on its spec).
        model, kv, adapters: the engine's. pool: the family's graph pool.
        stager: stages a step's live tensors (the capture of ``breakable`` needs an empty one).

    Buckets are built from the class attribute :attr:`bucket_class` (a subclass or an instance may
    swap it: the suite's engine-level faulty variants do).
    """

    bucket_class: type[GraphBucket] = GraphBucket

    def __init__(self, family: str, mode: str, sizes: tuple[int, ...], request_slots: Callable[[int], int], *,
                 make_backend: Callable[[], object], model: MoEDecoder, kv: KVCache, adapters: AdapterPool,
                 pool: GraphPool, stager: ForwardBatchStager) -> None:
        self.family, self.mode, self.sizes = family, mode, tuple(sizes)
        self.request_slots = request_slots
        self.make_backend = make_backend
        self.model, self.kv, self.adapters, self.pool, self.stager = model, kv, adapters, pool, stager
        self.buckets: dict[int, GraphBucket] = {}
        self.captures = 0

    def choose(self, host: ForwardBatchHost) -> BucketChoice:
        """The smallest bucket ``host`` fits, or why none does (host numbers only)."""
        bs, tokens = len(host.seq_lens), host.num_tokens
        largest = self.sizes[-1]
        if self.family == "decode":
            if bs > largest:
                return BucketChoice(None, "over_requests", f"{bs} requests > the largest decode bucket {largest}")
            return BucketChoice(next(s for s in self.sizes if s >= bs))
        slots = self.request_slots(largest)
        if bs > slots:
            return BucketChoice(None, "over_requests", f"{bs} requests > {slots} request slots of the prefill graph")
        if tokens > largest:
            return BucketChoice(None, "over_tokens", f"{tokens} tokens > the largest prefill bucket {largest}")
        return BucketChoice(next(s for s in self.sizes if s >= tokens))

    def bucket(self, size: int) -> GraphBucket:
        """The bucket of ``size``, built and captured now if it was not yet."""
        bucket = self.buckets.get(size)
        if bucket is None:
            backend = self.make_backend()
            requests = size if self.family == "decode" else self.request_slots(size)
            bucket = self.bucket_class(family=self.family, mode=self.mode, tokens=size, requests=requests,
                                       backend=backend, model=self.model, kv=self.kv, adapters=self.adapters,
                                       pool=self.pool)
            self.adapters.attach_backend(backend)
            self.buckets[size] = bucket
        if not bucket.captured:
            bucket.capture(empty_host(self.adapters), self.stager)
            self.captures += 1
        return bucket

    def capture_all(self) -> None:
        """Build and capture every bucket (start-up capture)."""
        for size in self.sizes:
            self.bucket(size)
