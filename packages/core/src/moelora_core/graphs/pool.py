"""The graph API of DESIGN.md §6: one pool per graph family, capture a callable, replay.

::

    pools = graph_pools(device)                   # {"decode": GraphPool, "prefill": GraphPool}
    x = torch.zeros(max_bs, H, device=device)     # static input, written in place per batch
    graph = pools["decode"].capture(lambda: layer(x))
    for batch in batches:
        x[: len(batch)].copy_(batch); x[len(batch):].zero_()
        y = graph.replay()                        # the same output tensor every time

On a CUDA device a pool is a ``torch.cuda.graph_pool_handle()`` shared by the graphs of its
family, and capture is ``torch.cuda.CUDAGraph`` after warm-up on a side stream. Elsewhere (or
with ``kind="emulated"``) capture goes to the emulator (:mod:`.emulator`). Either way capture
does not leave the work done: call ``replay()`` to run it. A host sync during capture raises
:class:`~moelora_core.errors.HostSyncError` on both kinds.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from moelora_core.capabilities import GRAPH_FAMILIES
from moelora_core.errors import HostSyncError, InvalidFieldError
from moelora_core.graphs.emulator import capture_emulated

#: The two implementations behind the one API.
GRAPH_KINDS: tuple[str, ...] = ("cuda", "emulated")

# Fragments of the errors CUDA / PyTorch raise when a capture meets a host sync.
_CAPTURE_ERRORS = ("stream is capturing", "during capture", "during cuda graph capture",
                   "cudaerrorstreamcapture")


class CapturedGraph(Protocol):
    """What ``GraphPool.capture`` returns, on either kind.

    Attributes:
        kind: "cuda" or "emulated".
        family: the pool's family ("decode" / "prefill").
        output: what the callable returned during capture; its tensors are the graph's static
            outputs, rewritten by every replay (meaningless before the first replay).
    """

    kind: str
    family: str
    output: object

    def replay(self) -> object:
        """Run the captured work on the current contents of the static inputs; returns ``output``."""
        ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` behind the common interface (built by ``GraphPool.capture``)."""

    kind = "cuda"

    def __init__(self, family: str, graph: torch.cuda.CUDAGraph, output: object) -> None:
        self.family = family
        self.output = output
        self._graph = graph

    def replay(self) -> object:
        self._graph.replay()
        return self.output


def _is_capture_error(exc: BaseException) -> bool:
    seen = exc
    while seen is not None:
        text = str(seen).lower()
        if any(fragment in text for fragment in _CAPTURE_ERRORS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class GraphPool:
    """The graphs of one family, sharing one memory pool.

    Args:
        family: "decode" or "prefill" (``GRAPH_FAMILIES``); families never share a pool.
        device: where the captured programs compute.
        kind: "cuda" (``torch.cuda.CUDAGraph``; needs a CUDA device), "emulated" (the CPU
            emulator, on any device), or None for "cuda" on a CUDA device and "emulated"
            elsewhere.

    Raises:
        InvalidFieldError: unknown family or kind, or kind "cuda" without a CUDA device.
    """

    def __init__(self, family: str, device: torch.device | str, *, kind: str | None = None) -> None:
        if family not in GRAPH_FAMILIES:
            raise InvalidFieldError("family", f"unknown graph family {family!r}; expected one of {GRAPH_FAMILIES}")
        self.device = torch.device(device)
        if kind is None:
            kind = "cuda" if self.device.type == "cuda" else "emulated"
        if kind not in GRAPH_KINDS:
            raise InvalidFieldError("kind", f"unknown graph kind {kind!r}; expected one of {GRAPH_KINDS}")
        if kind == "cuda" and self.device.type != "cuda":
            raise InvalidFieldError("kind", f"'cuda' graphs need a CUDA device, got {self.device}")
        self.family = family
        self.kind = kind
        self.graphs: list[CapturedGraph] = []
        self._handle = torch.cuda.graph_pool_handle() if kind == "cuda" else None

    @property
    def default_warmup(self) -> int:
        """Eager warm-up calls before a capture when the caller names none: 1 on CUDA (lazy
        initialisation, Triton compilation and autotuning outside the capture), 0 on the emulator
        (its capture runs the callable itself, so a warm-up would only repeat it). The one rule the
        engine's buckets and the suite's harness (``LayerGraph``) both capture under (DESIGN.md §6)."""
        return 1 if self.kind == "cuda" else 0

    def capture(self, fn: Callable[[], object], *, warmup: int | None = None) -> CapturedGraph:
        """Warm up ``fn`` eagerly ``warmup`` times (None: :attr:`default_warmup`), then capture one call of it.

        ``fn`` takes no arguments: it reads static inputs (tensors allocated before capture and
        written in place between replays) and returns its outputs.

        Raises:
            HostSyncError: ``fn`` synchronises with the host during capture (nothing captured).
            InvalidFieldError: ``warmup`` < 0.
        """
        if warmup is None:
            warmup = self.default_warmup
        if warmup < 0:
            raise InvalidFieldError("warmup", f"must be >= 0, got {warmup}")
        if self.kind == "emulated":
            for _ in range(warmup):
                fn()
            with collector_paused():
                graph: CapturedGraph = capture_emulated(fn, self.device, self.family)
        else:
            graph = self._capture_cuda(fn, warmup)
        self.graphs.append(graph)
        return graph

    def _capture_cuda(self, fn: Callable[[], object], warmup: int) -> CudaGraph:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # captured on the warm-up stream: a callee that keys scratch by the current stream
            # (SGLang's LoraWorkspace: "warm on the streams used during capture") finds at capture
            # what warm-up made (test_capture_runs_on_the_warmup_stream).
            with collector_paused(), torch.cuda.graph(graph, pool=self._handle, stream=side):
                output = fn()
        except BaseException as exc:
            self._after_failed_capture(current)
            if isinstance(exc, RuntimeError) and _is_capture_error(exc):
                raise HostSyncError(f"host sync during CUDA graph capture ({self.family}): {exc}") from exc
            raise
        return CudaGraph(self.family, graph, output)

    def _after_failed_capture(self, current: torch.cuda.Stream) -> None:
        """Leave the pool and the thread's stream usable after a capture that raised.

        ``torch.cuda.graph`` restores the caller's stream only when ``capture_end`` succeeds: after
        an invalidated capture the thread stayed on torch's capture stream, and every later eager
        kernel and capture of the process ran there (seen on the H200 with the engine's graph
        tests). The caller's stream ``current`` is made current again.

        When a host sync invalidates a CUDA stream capture, ``CUDAGraph.capture_end`` fails at
        ``cudaStreamEndCapture`` before it tells the caching allocator to stop recording into the
        pool, so the next capture into the same pool failed with "beginAllocateToPool: already
        recording to mempool_id" and later work with "invalid argument" (found on the H200 by the
        engine's graph tests: a bucket captured after a refused capture; named test
        ``test_a_failed_cuda_capture_leaves_its_pool_usable``). The recording is ended here if it is
        still open, and the pool takes a fresh handle, so nothing of the failed capture is reused.
        """
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(index, self._handle)
        except RuntimeError:
            pass  # capture_end got as far as ending the recording itself
        self._handle = torch.cuda.graph_pool_handle()
        torch.cuda.set_stream(current)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector off for the body (a capture).

    An automatic collection inside a capture can free an earlier engine's CUDA graph or pinned
    buffers; their destructors call CUDA APIs a capturing process may not call (``CUDAGraph.reset``
    warned "operation not permitted when stream is capturing") and the capture in progress is
    invalidated. With the collector off, garbage waits for the next collection outside a capture
    (SGLang and vLLM freeze the collector around their captures in the same way; no collection is
    forced here, it would cost every bucket's capture a full pass over the heap). Found on the
    H200: a breakable capture failed only after earlier tests had left engines to collect
    (``test_a_collection_during_capture_cannot_free_cuda_objects``). Used on both graph kinds, so
    the emulator's capture runs under the same rule.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graph_pools(device: torch.device | str, *, kind: str | None = None) -> dict[str, GraphPool]:
    """One :class:`GraphPool` per family of ``GRAPH_FAMILIES`` on ``device``."""
    return {family: GraphPool(family, device, kind=kind) for family in GRAPH_FAMILIES}
