"""The layer harness graph modes of DESIGN.md §6.

A layer is three callables, as in a transformer block of an MoE model serving LoRA:

    projection()  -> a      the dense LoRA projection (e.g. q/k/v), reading static inputs
    break_op(a)   -> b      an op that reads live per-request metadata, like attention
    moe(b)        -> y      the MoE LoRA layer

- ``full``: one graph captures all three; the break op is replayed too, so it must read its
  metadata from static buffers (what a prefill graph with graph-safe attention does).
- ``breakable``: two graphs, projection and MoE, with the break op run eagerly between them on
  live metadata (what piecewise / breakable graphs do around attention). Its output is copied
  into a static input of the second graph, so it must keep the shape it had at capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelora_core.capabilities import PREFILL_GRAPH_MODES
from moelora_core.errors import InvalidFieldError
from moelora_core.graphs.pool import CapturedGraph, GraphPool


class LayerGraph:
    """Capture a projection -> break op -> MoE layer once in ``mode``, then replay it.

    Args:
        projection: () -> a [T, ...]; reads static inputs.
        break_op: (a) -> b; reads live metadata (``breakable``) or static buffers (``full``).
        moe: (b) -> y.
        mode: "full" or "breakable" (``PREFILL_GRAPH_MODES``).
        pool: the family's pool (both graphs of ``breakable`` share it).
        warmup: eager warm-up calls before each capture; None: the pool's rule
            (``GraphPool.default_warmup``, the engine's too).

    Raises:
        InvalidFieldError: unknown mode.
    """

    def __init__(
        self,
        projection: Callable[[], torch.Tensor],
        break_op: Callable[[torch.Tensor], torch.Tensor],
        moe: Callable[[torch.Tensor], torch.Tensor],
        *,
        mode: str,
        pool: GraphPool,
        warmup: int | None = None,
    ) -> None:
        if mode not in PREFILL_GRAPH_MODES:
            raise InvalidFieldError("mode", f"unknown layer graph mode {mode!r}; expected one of {PREFILL_GRAPH_MODES}")
        self.projection, self.break_op, self.moe = projection, break_op, moe
        self.mode = mode
        self.pool = pool
        self.warmup = warmup
        self.graphs: tuple[CapturedGraph, ...] = ()
        self._break_in: torch.Tensor | None = None

    def eager(self) -> torch.Tensor:
        """The three callables run eagerly (the reference a replay is compared with)."""
        return self.moe(self.break_op(self.projection()))

    def capture(self) -> None:
        """Capture once (a second call raises: graphs of a layer are captured once per mode).

        Raises:
            InvalidFieldError: already captured.
            HostSyncError: a captured callable synchronises with the host.
        """
        if self.graphs:
            raise InvalidFieldError("capture", f"this {self.mode} LayerGraph is already captured")
        if self.mode == "full":
            self.graphs = (self.pool.capture(self.eager, warmup=self.warmup),)
            return
        first = self.pool.capture(self.projection, warmup=self.warmup)
        # The second segment reads the break op's output from a static buffer; its shape and
        # dtype come from one eager run.
        self._break_in = self.break_op(self.projection()).clone()
        break_in = self._break_in
        second = self.pool.capture(lambda: self.moe(break_in), warmup=self.warmup)
        self.graphs = (first, second)

    def replay(self) -> torch.Tensor:
        """Replay the captured graph(s); ``breakable`` runs the break op eagerly in between.

        Returns:
            y, the output of the (last) graph: the same tensor on every replay.

        Raises:
            InvalidFieldError: not captured yet, or the break op's output changed shape or dtype.
        """
        if not self.graphs:
            raise InvalidFieldError("replay", "capture() the LayerGraph before replaying it")
        if self.mode == "full":
            return self.graphs[0].replay()
        first, second = self.graphs
        b = self.break_op(first.replay())
        static = self._break_in
        if b.shape != static.shape or b.dtype != static.dtype:
            raise InvalidFieldError(
                "break_op", f"returned {tuple(b.shape)} {b.dtype}, the captured segment reads "
                f"{tuple(static.shape)} {static.dtype}"
            )
        static.copy_(b)
        return second.replay()
