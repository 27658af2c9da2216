"""The graph runners of DESIGN.md §6: whole forwards captured once per bucket, replayed with live
LoRA metadata written in place.

A :class:`GraphRunner` is one graph family ("decode" or "prefill") of an engine. It holds **one
buffer set**, allocated once at the family's largest bucket, as production engines do (SGLang's
``init_cuda_graph_batch_info(max_bs, ...)``, vLLM's one ``LoRAKernelMeta``, nano-vllm's
``capture_cudagraph`` over ``[:bs]`` views of one set of graph variables):

- the engine's **one backend instance** (the eager passes' too), whose family is initialised once,
  ``init_graph(family, capacity of the largest bucket)``: every bucket's LoRA metadata is a view of
  that family's static buffers (``prepare(batch, family, bucket=...)``), and decode and prefill
  families own separate buffers (the backend's contract);
- one :class:`~moelora_runner.forward_batch.StaticForwardBatch` (tokens, positions, KV locations,
  logits rows; attention's key width fixed to the KV table's width), whose views each bucket reads;
- for ``breakable``, one static input of the post-attention segments;
- one :class:`~moelora_core.graphs.GraphPool` (on CUDA one memory pool shared by the family's graphs).

So replaying a small bucket after a larger batch reads the same memory a production engine's does,
and a backend that leaves a larger batch's tail in its buffers shows it here, where the e2e suite can
see it (DESIGN.md §6, §9).

A :class:`GraphBucket` is one captured size of the family, its graph(s) captured over the views of
its capacity:

- ``full`` (the decode graph and prefill ``full``): one graph of
  :meth:`~moelora_runner.model.MoEDecoder.hidden_states` — embed, every layer, attention included
  (attention reads the static batch: graph-safe);
- ``breakable`` (prefill): L + 1 graphs, the segments between attention calls (embed + layer 0
  pre-attention; post-attention(i) + pre-attention(i + 1); the last post-attention). Attention runs
  eagerly between replays on the step's **live, unpadded** rows (the views of its own rows; its own
  longest context): it writes the live rows' K/V and attends over them, and its output is copied into
  the next segment's static input (pad rows zeroed). The LoRA and MoE work is inside the segments.

A step is staged once: its lists are written into the bucket's views (:meth:`GraphBucket.stage`),
and the live batch the LM head and the eager attention read is the views of its own rows. The
graph's output is the final hidden states of the bucket's rows; the LM head runs after the replay on
the step's ``logits_indices`` rows (a [tokens × vocab] tensor inside a graph would be wasted at real
vocabulary sizes).

Capture runs on an IDLE batch written into the static buffers (every row a pad row, every request
slot empty), so nothing of a real batch is frozen into the graph; the backend's ``prepare`` must
answer it with ``has_active_lora`` True (the LoRA kernels are recorded and exit early on the device
for unused slots) or the capture is refused (:class:`~moelora_runner.errors.GraphCaptureError`). The
addresses and lengths of the info's device tensors are recorded then and checked at every later
``prepare``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode
from moelora_core.graphs import CapturedGraph, GraphPool
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.errors import GraphCaptureError
from moelora_runner.forward_batch import ForwardBatch, ForwardBatchHost, StaticForwardBatch
from moelora_runner.kv_cache import NULL_LOCATION, KVCache
from moelora_runner.model import LoRAContext, MoEDecoder

#: Eager-fallback reasons (``moelora_forward_passes_total{reason}``); graph passes carry "".
REASONS = {
    "disabled": "no graph runs this phase (eager mode, or the decode graph is off)",
    "over_tokens": "more tokens than the largest token bucket",
    "over_requests": "more requests than the graph's request slots (decode: the largest batch bucket)",
    "backend_fallback": "the backend's prepare answered Fallback for the bucket's family",
}


def _tensor_signature(info: LoRABatchInfo) -> dict[str, tuple[int, int]]:
    """(data_ptr, numel) of every device tensor of ``info``, private ones included."""
    out = {name: (t.data_ptr(), t.numel()) for name, t in info.device_tensors().items()}
    out.update({f"private.{k}": (v.data_ptr(), v.numel()) for k, v in info.private.items()
                if isinstance(v, torch.Tensor)})
    return out


def empty_host(adapters: AdapterPool) -> ForwardBatchHost:
    """An IDLE step (no token, no request): what a bucket is captured on."""
    spec = BatchSpec(ForwardMode.IDLE, [], adapters.max_loras, adapters.slot_ranks(), adapters.slot_scalings())
    return ForwardBatchHost(spec, (), (), (), (), (), (), ())


def family_capacity(family: str, tokens: int, requests: int) -> GraphCapacity:
    """The ``GraphCapacity`` of a bucket of ``tokens`` tokens and ``requests`` request slots."""
    return GraphCapacity.decode(requests) if family == "decode" else GraphCapacity.prefill(tokens, requests)


class GraphBucket:
    """One captured size of one graph family, over views of the family's buffer set (module doc).

    Args:
        runner: the family's :class:`GraphRunner` (its backend, static batch, pool, model, KV cache).
        tokens, requests: the bucket's token and request capacity (decode: both the batch size).
    """

    def __init__(self, *, runner: GraphRunner, tokens: int, requests: int) -> None:
        self.runner = runner
        self.family, self.mode = runner.family, runner.mode
        self.tokens, self.requests = tokens, requests
        self.capacity = family_capacity(self.family, tokens, requests)
        self.backend = runner.backend
        self.model, self.kv, self.pool = runner.model, runner.kv, runner.pool
        self.static = runner.static
        self.lora = runner.lora
        self.graphs: list[CapturedGraph] = []
        self.capture_info: LoRABatchInfo | None = None
        self._signature: dict[str, tuple[int, int]] = {}

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _name(self) -> str:
        return f"{self.family} bucket {self.tokens} tokens / {self.requests} requests"

    def prepare(self, spec: BatchSpec) -> LoRABatchInfo | Fallback:
        """The backend's ``prepare(spec, family, bucket=...)`` (writes its static buffers' views in place).

        Raises:
            GraphCaptureError: the info's device tensors are not the captured views.
        """
        info = self.backend.prepare(spec, family=self.family, bucket=self.capacity)
        if isinstance(info, Fallback) or not self._signature:
            return info
        moved = sorted(k for k, sig in _tensor_signature(info).items() if self._signature.get(k) != sig)
        if moved:
            raise GraphCaptureError(f"{self._name()}: backend {self.backend.name!r} returned device tensors other "
                                    f"than the captured ones for {moved}; graph-mode metadata must be written in "
                                    "place into the family's static buffers, as views of the bucket's lengths")
        return info

    def stage(self, host: ForwardBatchHost, info: LoRABatchInfo) -> ForwardBatch:
        """Write the step's lists into the bucket's views of the static batch (once per step); the live
        batch: the views of the step's own rows, with ``info``."""
        return self.static.write(host, info, tokens=self.tokens, requests=self.requests)

    # --- capture -------------------------------------------------------------------------------

    def capture(self, idle: ForwardBatchHost) -> None:
        """Capture the bucket on the IDLE step ``idle`` (module doc). Capture does no work.

        Raises:
            GraphCaptureError: the backend answered the capture batch with ``Fallback`` or with
                ``has_active_lora`` False.
            HostSyncError: a host sync in a captured callable.
        """
        info = self.backend.prepare(idle.batch_spec, family=self.family, bucket=self.capacity)
        if isinstance(info, Fallback):
            raise GraphCaptureError(f"{self._name()}: backend {self.backend.name!r} answered the capture batch with "
                                    f"Fallback({info.reason!r})")
        if not info.has_active_lora:
            raise GraphCaptureError(f"{self._name()}: backend {self.backend.name!r} prepared the capture batch with "
                                    "has_active_lora False: the LoRA kernels would not be recorded and no replay "
                                    "would add a delta (DESIGN.md §3)")
        self.capture_info = info
        self._signature = _tensor_signature(info)
        live = self.stage(idle, info)
        fb = self.static.forward_batch(info, tokens=self.tokens, requests=self.requests)
        if self.mode == "full":
            self.graphs = [self.pool.capture(lambda: self.model.hidden_states(fb, self.kv, self.lora))]
            return
        self._capture_segments(fb, live)

    def _capture_segments(self, fb: ForwardBatch, live: ForwardBatch) -> None:
        model, lora = self.model, self.lora
        # The static input of every post-attention segment (the family's, this bucket's rows): the eager
        # attention's output lands here.
        attn_in = self.runner.attention_input()[: self.tokens]

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
        graphs = [self.pool.capture(first)]
        out = graphs[0].replay()
        for i in range(model.num_layers):
            self._attend(i, out, live)
            segment = middle(i, out[0]) if i + 1 < model.num_layers else last(out[0])
            graphs.append(self.pool.capture(segment))
            out = graphs[-1].replay()
        self.graphs = graphs

    # --- replay --------------------------------------------------------------------------------

    def _attend(self, i: int, out: tuple, live: ForwardBatch) -> None:
        """Layer ``i``'s attention eagerly on the live rows; its output into the static input."""
        _, q, k, v = out
        T = live.num_tokens
        attn = self.model.attention(i, q[:T], k[:T], v[:T], live, self.kv)
        attn_in = self.runner.attention_input()
        attn_in[:T].copy_(attn)
        attn_in[T:self.tokens].zero_()

    def replay(self, live: ForwardBatch) -> torch.Tensor:
        """Replay the bucket on the step :meth:`stage` wrote (the backend's buffers already prepared).

        Args:
            live: the step's live batch from :meth:`stage` (the eager attention of ``breakable``; the
                caller's LM head).

        Returns:
            [tokens, H] final hidden states of the bucket's rows (the step's rows first).
        """
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
    """One graph family of an engine: its buffer set (module doc) and its buckets, built and captured on
    first use or all at start-up.

    Args:
        family: "decode" (buckets by batch size) or "prefill" (buckets by tokens).
        mode: "full" or "breakable". sizes: the bucket sizes (ascending).
        request_slots: request capacity of the bucket of a size.
        backend: the engine's backend (one instance for the eager passes and every bucket of both
            families); its family is initialised here, at the largest bucket.
        model, kv, adapters: the engine's. pool: the family's graph pool.

    Raises:
        InvalidFieldError: the backend refuses the family's capacity.
    """

    def __init__(self, family: str, mode: str, sizes: tuple[int, ...], request_slots: Callable[[int], int], *,
                 backend: object, model: MoEDecoder, kv: KVCache, adapters: AdapterPool, pool: GraphPool) -> None:
        self.family, self.mode, self.sizes = family, mode, tuple(sizes)
        self.request_slots = request_slots
        self.backend = backend
        self.model, self.kv, self.adapters, self.pool = model, kv, adapters, pool
        self.lora = LoRAContext(backend, adapters.pools)
        largest = self.sizes[-1]
        tokens, requests = largest, self._requests(largest)
        self.capacity = family_capacity(family, tokens, requests)
        backend.init_graph(family, self.capacity)  # once: every bucket reads views of these buffers
        self.static = StaticForwardBatch(max_tokens=tokens, max_requests=requests, max_context=kv.max_context,
                                         null_location=NULL_LOCATION, padding_row=kv.padding_row, device=pool.device)
        self._attn_in: torch.Tensor | None = None
        self.buckets: dict[int, GraphBucket] = {}
        self.captures = 0

    def _requests(self, size: int) -> int:
        return size if self.family == "decode" else self.request_slots(size)

    def attention_input(self) -> torch.Tensor:
        """``breakable``: the static input of the post-attention segments, [largest bucket's tokens,
        attention width] (allocated on first use; each bucket reads its rows)."""
        if self._attn_in is None:
            m = self.model
            self._attn_in = torch.zeros(self.static.max_tokens, m.attention_width, dtype=m.dtype,
                                        device=self.pool.device)
        return self._attn_in

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
            bucket = GraphBucket(runner=self, tokens=size, requests=self._requests(size))
            self.buckets[size] = bucket
        if not bucket.captured:
            bucket.capture(empty_host(self.adapters))
            self.captures += 1
        return bucket

    def capture_all(self) -> None:
        """Build and capture every bucket (start-up capture)."""
        for size in self.sizes:
            self.bucket(size)

    def buffer_bytes(self) -> int:
        """Device bytes of the family's buffer set: the backend's static buffers (distinct storages) and
        the static batch (the graphs' own memory pool not included)."""
        seen: dict[int, int] = {}
        static_buffers = getattr(self.backend, "static_buffers", None)
        tensors = list(static_buffers(self.family).values()) if callable(static_buffers) else []
        tensors += [b.tensor for b in self.static.buffers.values()]
        if self._attn_in is not None:
            tensors.append(self._attn_in)
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())
