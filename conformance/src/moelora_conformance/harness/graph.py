"""The layer harness under the graph API (DESIGN.md §6): the decode family and the prefill ``full``
and ``breakable`` modes.

A :class:`GraphLayer` owns the static inputs of one graph mode on one :class:`~.layer.Layer`
(activations, routing and dense inputs at token capacity; the break op's request map), initialises
the backend's graph family with the given capacities, and captures the layer once, on the first
batch it runs, with the metadata that first ``prepare(batch, family)`` returned. Every later batch
is written in place: activations into the static inputs (rows past the live tokens get fresh random
values with valid expert ids, :func:`~.inputs.pad_rows`), metadata by ``prepare(batch, family)`` into
the backend's static buffers, and the graph is replayed. What the captured program read at capture
is what it reads on every replay, as on CUDA.

Modes:

- ``decode``: the decode family, one graph of projection → break op → MoE (the break op from static
  buffers; every MoE layer of the case — two layers are two MoE layers in one captured program);
- ``prefill-full``: the prefill family, the same single graph;
- ``prefill-breakable``: the prefill family, a graph of the projection and a graph of the MoE, with
  the break op run eagerly in between from the live batch (``LayerGraph`` "breakable").

A batch the family refuses (``Fallback``) runs eagerly; the output says so.
"""

from __future__ import annotations

import torch

from moelora_conformance.harness.break_op import LiveRequests, StaticRequests
from moelora_conformance.harness.inputs import BatchInputs, pad_rows
from moelora_conformance.harness.layer import Layer, LayerOutput, all_base
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Fallback
from moelora_core.errors import InvalidFieldError
from moelora_core.graphs import GraphPool, LayerGraph

#: Graph modes of the harness → (graph family, LayerGraph mode).
GRAPH_MODES: dict[str, tuple[str, str]] = {
    "decode": ("decode", "full"),
    "prefill-full": ("prefill", "full"),
    "prefill-breakable": ("prefill", "breakable"),
}


class GraphLayer:
    """One graph mode of a layer: static inputs, the family's capacities, one capture.

    Args:
        layer: the layer (backend + weights).
        mode: a key of :data:`GRAPH_MODES`.
        max_requests: request capacity (decode: ``max_bs``).
        max_tokens: token capacity of the prefill family (ignored for decode).
        tokens_per_request: the decode family's tokens per request (ignored for prefill, None there).
        pad_seed: seed of the pad rows' values.

    Raises:
        InvalidFieldError: an unknown mode or a capacity < 1.
    """

    def __init__(self, layer: Layer, mode: str, *, max_requests: int, max_tokens: int | None = None,
                 tokens_per_request: int | None = 1, pad_seed: int = 0) -> None:
        if mode not in GRAPH_MODES:
            raise InvalidFieldError("mode", f"unknown graph mode {mode!r}; expected one of {tuple(GRAPH_MODES)}")
        self.layer = layer
        self.mode = mode
        self.family, self.layer_mode = GRAPH_MODES[mode]
        backend = layer.backend
        if self.family == "decode":
            self.tokens_per_request = tokens_per_request
            family_capacity = GraphCapacity.decode(max_requests, tokens_per_request)
        else:
            self.tokens_per_request = None
            family_capacity = GraphCapacity.prefill(max_tokens, max_requests)
        self.capacity = family_capacity.max_tokens
        backend.init_graph(self.family, family_capacity)
        self.max_requests = max_requests
        device = layer.device
        self.pad = pad_rows(layer.m, self.capacity, pad_seed)
        self.x = self.pad.x.clone()
        self.topk_ids = self.pad.topk_ids.clone()
        self.topk_weights = self.pad.topk_weights.clone()
        self.dense_x = {m: t.clone() for m, t in self.pad.dense_x.items()}
        self.extra_routing = tuple((i.clone(), w.clone()) for i, w in self.pad.extra_routing)
        if self.layer_mode == "full":
            self.breaker = StaticRequests(device, self.capacity, max_requests)
        else:
            self.breaker = LiveRequests(device, self.capacity)
        self.pool = GraphPool(self.family, device)
        self.graph: LayerGraph | None = None
        self.info: LoRABatchInfo | None = None  # the metadata the graph was captured with
        self.batch = None
        self._staged: tuple[BatchInputs, LoRABatchInfo] | None = None
        self._dense: dict[str, torch.Tensor] = {}
        self.captures = 0

    # --- the captured callables -----------------------------------------------------------------

    def _projection(self) -> dict[str, torch.Tensor]:
        return self.layer.projection(self.dense_x, self.info)

    def _break(self, dense: dict[str, torch.Tensor]) -> torch.Tensor:
        self._dense = dense  # the graph's own output tensors: rewritten by every replay
        return self.breaker(self.x, dense)

    def _moe(self, moe_in: torch.Tensor):
        y, y32 = self.layer.moe(moe_in, self.topk_ids, self.topk_weights, self.info)
        return y, y32, moe_in, self.layer.extra_moe(y, self.extra_routing, self.info)

    # --- running batches ------------------------------------------------------------------------

    def write_inputs(self, inp: BatchInputs) -> None:
        """Write ``inp``'s rows into the static inputs' head and fresh pad values into the rest.

        Raises:
            InvalidFieldError: more tokens than the capacity.
        """
        T = inp.num_tokens
        if T > self.capacity:
            raise InvalidFieldError("batch", f"{T} tokens > the {self.mode} static inputs' {self.capacity} rows")
        extra = [(dst, pad, live) for (di, dw), (pi, pw), (li, lw) in
                 zip(self.extra_routing, self.pad.extra_routing, inp.extra_routing, strict=True)
                 for dst, pad, live in ((di, pi, li), (dw, pw, lw))]
        for dst, pad, live in ((self.x, self.pad.x, inp.x), (self.topk_ids, self.pad.topk_ids, inp.topk_ids),
                               (self.topk_weights, self.pad.topk_weights, inp.topk_weights),
                               *((self.dense_x[m], self.pad.dense_x[m], inp.dense_x[m]) for m in self.dense_x),
                               *extra):
            dst.copy_(pad)
            dst[:T].copy_(live)

    def prepare(self, inp: BatchInputs) -> LoRABatchInfo | Fallback:
        """``backend.prepare(batch, family)`` (writes the backend's static buffers in place)."""
        return self.layer.backend.prepare(inp.batch, self.family)

    def stage(self, inp: BatchInputs) -> LoRABatchInfo | Fallback:
        """Prepare ``inp`` in the family and write its rows into the static inputs, without
        replaying (:meth:`replay` runs it). A ``Fallback`` stages nothing."""
        info = self.prepare(inp)
        self.layer.after_backend_call(f"prepare(batch, {self.family!r})")
        if isinstance(info, Fallback):
            return info
        self.write_inputs(inp)
        self.breaker.set_batch(inp.batch)
        self.batch = inp.batch
        self._staged = (inp, info)
        return info

    def replay(self) -> LayerOutput:
        """Capture (first time) and replay the staged batch.

        Returns:
            The live rows (clones; capacity-wide tensors in ``rows``).

        Raises:
            InvalidFieldError: nothing is staged.
        """
        if self._staged is None:
            raise InvalidFieldError("replay", "stage a batch first")
        inp, info = self._staged
        self._staged = None
        if self.graph is None:
            self.info = info
            self.graph = LayerGraph(self._projection, self._break, self._moe, mode=self.layer_mode, pool=self.pool)
            self.layer.capturing = True
            try:
                self.graph.capture()
            finally:
                self.layer.capturing = False
            self.layer.after_backend_call(f"the {self.mode} graph's capture")
            self.captures += 1
        y, y32, moe_in, extra = self.graph.replay()
        self.layer.after_backend_call(f"a {self.mode} replay")
        guards = self._dense.guards()
        full = LayerOutput({m: t.clone() for m, t in self._dense.items()}, moe_in.clone(), y.clone(),
                           None if y32 is None else y32.clone(), info, extra=[e.clone() for e in extra],
                           guards=None if guards is None else guards.clone())
        return full.live(inp.num_tokens)

    def run(self, inp: BatchInputs) -> LayerOutput:
        """Stage ``inp`` and replay it. A batch the family refuses runs eagerly and the output
        carries the ``Fallback``."""
        info = self.stage(inp)
        if isinstance(info, Fallback):
            out = self.layer.eager(inp)
            out.fallback = info
            return out
        return self.replay()

    def disabled(self, run: LayerOutput) -> LayerOutput:
        """The LoRA-disabled twin of the last replay ``run``, eagerly on the current static inputs
        at capacity (same shapes): base dense outputs and every MoE layer without LoRA on the
        replay's own input to it. The live rows, with the capacity-wide tensors in ``rows``
        (bitwise checks of base and pad rows)."""
        if self.batch is None or not run.rows:
            raise InvalidFieldError("disabled", "needs the output of this graph layer's last replay")
        layer = self.layer
        dense = layer.dense_base(self.dense_x)
        info = None
        if layer.moe_path == "fused":
            extra = self.capacity - self.batch.num_tokens
            info = layer.backend.prepare(all_base(self.batch, extra, self.tokens_per_request))
            layer.after_backend_call("prepare (all base, capacity)")
        twin = layer.disabled_moe(run, info, self.topk_ids, self.topk_weights, self.extra_routing, dense)
        return twin.live(self.batch.num_tokens)
