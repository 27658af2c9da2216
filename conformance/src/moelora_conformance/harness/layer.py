"""The layer harness: one backend on one case's layer, run eagerly (graph modes: :mod:`.graph`).

A forward is the three parts of DESIGN.md §6:

1. **projection**: for every dense module m of the spec, ``out_m = dense_x_m W_mᵀ`` (fp32, rounded
   once to the case dtype), then ``backend.dense_delta(m, dense_x_m, out_m, ...)`` in place. With
   the case's ``fused-qkv`` layout, ``out_q``, ``out_k``, ``out_v`` are column slices of one buffer
   (strided views, as an engine's fused qkv projection passes them) between guard columns that
   hold :data:`GUARD_VALUE`: a delta written outside its slice changes a guard or a neighbour;
2. **break op** (:mod:`.break_op`): ``moe_in = x · f(request's dense outputs)``, attention-like;
3. **MoE**: on the ``deltas`` paths, the reference's vectorised base MoE
   (:func:`moelora_reference.base_moe.moe_forward`) with the backend's deltas
   (``BackendMoEDeltas``: ``moe_gate_up_delta`` before the activation, ``moe_down_delta``
   router-weighted) — intermediates in fp32 (``deltas``) or, as engines store them, in the model
   dtype (``deltas-model``); ``y32`` keeps the fp32 sum before y's one rounding for the delta check;
   on the ``fused`` path (backends that declare ``fused_moe``), ``backend.moe_forward``. Cases with
   two MoE layers run a second one on the first one's output after an RMS norm
   (:func:`inter_layer_norm`), with its own base weights, pool and routing and the *same* metadata
   (one ``prepare`` per forward, as an engine runs every decoder layer on one batch info).

Reloading (:meth:`Layer.reload`): an adapter loaded into a slot between forwards (slot reuse,
eviction) goes through ``LoRAWeights.load_slot`` / ``clear_slot`` into every MoE layer's pool, in
place, exactly as an engine does it; captured graphs keep reading the same pool tensors. After every
load or clear — the case's initial pool once the backend is built, and every reload — the backend's
slot-load hook is called (``moelora_core.backend.notify_slot_loaded``), and what was loaded is
recorded in the case's :class:`~moelora_conformance.snapshot.AdapterSnapshot`, the oracle's source.

The pool is read-only to the backend: after every backend call the harness makes (``prepare``, each
delta, ``moe_forward``, the slot-load hook; a graph's capture and replays) a
:class:`~moelora_conformance.snapshot.PoolGuard` checks every pool bit for bit (inside a host-sync
guard or a capture the check waits for the region's end).

The LoRA-disabled twin of a run (:meth:`Layer.disabled`) is the same path with no LoRA on the
run's own inputs — the dense inputs, and the MoE input the run's break op produced: no backend
call at all on the ``deltas`` path, and ``moe_forward`` with the metadata of the same batch with
every request on ``NO_ADAPTER`` on the ``fused`` path ("base rows against its own LoRA-disabled
run"). Output minus twin is then exactly the LoRA delta of each part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelora_conformance.harness.break_op import LiveRequests
from moelora_conformance.harness.inputs import BatchInputs, case_inputs
from moelora_conformance.snapshot import AdapterSnapshot, PoolGuard
from moelora_conformance.strategies.adapters import SlotAdapter
from moelora_conformance.strategies.cases import FUSED_MODULES, MaterializedCase, MoELoRACase, adapter_modules
from moelora_core.backend import Backend, BackendFactory, check_base_quant_served, notify_slot_loaded
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch import BatchSpec, Request
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode
from moelora_core.moe_deltas import BackendMoEDeltas
from moelora_core.sentinels import NO_ADAPTER
from moelora_core.weights import LoRAWeights
from moelora_reference import base_moe

F32 = torch.float32
#: MoE paths of the harness: the backend's delta calls around the reference base MoE with fp32
#: intermediates ("deltas") or intermediates in the model dtype, as engines store them
#: ("deltas-model"), or the backend's own fused ``moe_forward`` ("fused").
MOE_PATHS: tuple[str, ...] = ("deltas", "deltas-model", "fused")
#: What the guard columns of a ``fused-qkv`` dense buffer hold (exact in every dtype); no delta may
#: change it.
GUARD_VALUE = -7.25


class DenseOutputs(dict):
    """module → [T, out] dense output (a column slice of ``fused`` for fused modules).

    Attributes:
        fused: the ``fused-qkv`` buffer [T, W] the fused modules' outputs are views of, else None.
        guard_columns: its columns outside every module's slice (they hold :data:`GUARD_VALUE`).
    """

    fused: torch.Tensor | None = None
    guard_columns: tuple[int, ...] = ()

    def guards(self) -> torch.Tensor | None:
        """[T, len(guard_columns)] a copy of the guard columns (None without a fused buffer)."""
        if self.fused is None:
            return None
        # Column by column: no index tensor to copy to the device (no host-to-device copy on CUDA).
        return torch.stack([self.fused[:, c] for c in self.guard_columns], dim=1)


def inter_layer_norm(y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The RMS norm (no weight) between two MoE layers, as a decoder applies before every MoE block.

    Without it the second layer of a two-layer case ran on the first one's raw output, and in fp16
    its exact output could pass 65504 (CI 2026-11-29, reference backend, P01 prefill fp16, H=4:
    oracle -77407, every correct backend -inf): a case no backend can pass. Computed in fp32 and
    rounded to ``y``'s dtype; row-wise (a pad row's result depends on that row only) and graph-safe
    (tensor ops, no host read). ``check_run`` checks layer 2's input against it on the same rows.

    Args:
        y: [T, H] a layer's output.

    Returns:
        [T, H] in ``y``'s dtype; rows with RMS well above ``sqrt(eps)`` get RMS 1 (zero rows stay 0).
    """
    y32 = y.float()
    return (y32 * torch.rsqrt(y32.square().mean(-1, keepdim=True) + eps)).to(y.dtype)


@dataclass
class MoEOutput:
    """One MoE layer's input and output in a forward: moe_in, y [T, H] (case dtype), y32 (fp32,
    ``deltas`` path) or None."""

    moe_in: torch.Tensor
    y: torch.Tensor
    y32: torch.Tensor | None

    def head(self, T: int) -> MoEOutput:
        return MoEOutput(self.moe_in[:T], self.y[:T], None if self.y32 is None else self.y32[:T])

    def clone(self) -> MoEOutput:
        return MoEOutput(self.moe_in.clone(), self.y.clone(), None if self.y32 is None else self.y32.clone())


@dataclass
class LayerOutput:
    """What one forward produced, on the live rows (graph runs: the first ``T`` rows of capacity).

    Attributes:
        dense: module → [T, out] projection output with LoRA (case dtype).
        moe_in: [T, H] the break op's output, the MoE input (case dtype).
        y: [T, H] MoE output (case dtype).
        y32: [T, H] fp32 MoE output before its one rounding (``deltas`` path), else None.
        info: the metadata the run used (graph runs: the static-buffer info).
        rows: the capacity-wide tensors of a graph run (``dense``, ``moe_in``, ``y``, ``y32``,
            ``extra``, ``guards``) for checks on pad rows; equal to the live ones in eager runs.
        fallback: the ``Fallback`` a graph family returned (the run was then eager), else None.
        extra: the MoE layers after the first (input: the previous layer's y, RMS-normalized).
        guards: [T, g] the guard columns of the ``fused-qkv`` dense buffer after the deltas, else None.
    """

    dense: dict[str, torch.Tensor]
    moe_in: torch.Tensor
    y: torch.Tensor
    y32: torch.Tensor | None
    info: LoRABatchInfo | None
    rows: dict[str, object] = field(default_factory=dict)
    fallback: Fallback | None = None
    extra: list[MoEOutput] = field(default_factory=list)
    guards: torch.Tensor | None = None

    def all_rows(self) -> dict[str, object]:
        """Every row of the run: ``rows`` (capacity-wide) for a graph run, else this output's own
        tensors under the same keys."""
        return self.rows or {"dense": self.dense, "moe_in": self.moe_in, "y": self.y, "y32": self.y32,
                             "extra": self.extra, "guards": self.guards}

    def live(self, T: int) -> LayerOutput:
        """The first ``T`` rows as a LayerOutput (keeping the full tensors in ``rows``)."""
        full = self.all_rows()
        return LayerOutput({m: t[:T] for m, t in self.dense.items()}, self.moe_in[:T], self.y[:T],
                           None if self.y32 is None else self.y32[:T], self.info, full, self.fallback,
                           [e.head(T) for e in self.extra], None if self.guards is None else self.guards[:T])


def all_base(batch: BatchSpec, extra_rows: int = 0, tokens_per_request: int | None = None) -> BatchSpec:
    """``batch`` with every request on ``NO_ADAPTER``, plus base requests covering ``extra_rows``
    pad rows (one EXTEND request, or DECODE requests of ``tokens_per_request`` tokens)."""
    requests = [Request(NO_ADAPTER, r.extend_len, r.prefix_len) for r in batch.requests]
    mode = batch.forward_mode
    if extra_rows:
        if tokens_per_request is not None:
            requests += [Request(NO_ADAPTER, tokens_per_request, 1)] * (extra_rows // tokens_per_request)
            mode = ForwardMode.DECODE
        else:
            requests.append(Request(NO_ADAPTER, extra_rows))
            mode = ForwardMode.EXTEND
    return BatchSpec(mode, requests, batch.max_loras, batch.lora_ranks, batch.scalings)


class _CheckedDeltas:
    """A layer's ``BackendMoEDeltas`` with the pool checked after each of its two calls."""

    def __init__(self, inner: BackendMoEDeltas, layer: Layer, index: int) -> None:
        self.inner, self.layer, self.index = inner, layer, index

    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor) -> None:
        self.inner.gate_up(x, topk_ids, gate_up_out)
        self.layer.after_backend_call(f"moe_gate_up_delta (MoE layer {self.index + 1})")

    def down(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             down_out: torch.Tensor) -> None:
        self.inner.down(h, topk_ids, topk_weights, down_out)
        self.layer.after_backend_call(f"moe_down_delta (MoE layer {self.index + 1})")


class Layer:
    """A backend built for a case's spec, the case's weights, and eager forwards.

    Args:
        factory: the backend factory under test.
        case: the drawn case (its seed gives every value).
        device: where tensors live.
        moe_path: "deltas", "deltas-model" or "fused" (:data:`MOE_PATHS`).
        materialized: reuse values already built for this case (e.g. to build a second backend
            on the same weights); default: ``case.materialize(device)``.
    """

    def __init__(self, factory: BackendFactory, case: MoELoRACase, device: torch.device | str, *,
                 moe_path: str = "deltas", materialized: MaterializedCase | None = None) -> None:
        if moe_path not in MOE_PATHS:
            raise ValueError(f"moe_path must be one of {MOE_PATHS}, got {moe_path!r}")
        self.case = case
        self.device = torch.device(device)
        self.m = materialized if materialized is not None else case.materialize(self.device)
        self.spec = self.m.spec
        self.backend: Backend = factory(self.spec)
        # A layer on a quantized base is refused by name for a backend that does not declare it.
        check_base_quant_served(getattr(self.backend, "name", "?"), self.backend.capabilities(), self.spec.base_quant)
        self.moe_path = moe_path
        #: dtype of gate_up_out, h and down_out on the ``deltas`` paths (fp32, or the model's).
        self.intermediate_dtype = self.spec.dtype if moe_path == "deltas-model" else F32
        self.weights = self.m.lora
        #: (base weights, pool) of every MoE layer, layer 1 first.
        self.moe_layers: list[tuple[MoEBaseWeights, LoRAWeights]] = [
            (self.m.base, self.m.lora), *((x.base, x.lora) for x in self.m.layers)]
        if self.m.snapshot is None:  # values built by hand (a test): record the pools as they are
            self.m.snapshot = AdapterSnapshot.of_pools([pool for _, pool in self.moe_layers])
        #: Bumped by every :meth:`reload` (the oracle re-reads the pools when it changes).
        self.pool_version = 0
        #: True while a graph captures this layer's calls (pool checks wait for the capture's end).
        self.capturing = False
        self._deferred: list[str] | None = None
        layout = case.dense_layout if case is not None else "contiguous"
        self._fused, self._guard_columns, self._fused_width = self._fused_layout(layout)
        self.pool_guard = PoolGuard([pool for _, pool in self.moe_layers])
        for pool in {id(p): p for _, p in self.moe_layers}.values():
            for slot in range(pool.spec.max_loras):
                if pool.slot_rank(slot):
                    notify_slot_loaded(self.backend, slot, pool)
                    self.after_backend_call(f"on_slot_loaded({slot})")

    @property
    def snapshot(self) -> AdapterSnapshot:
        """What the suite loaded into every MoE layer's pool (the oracle reads this, never the pools)."""
        return self.m.snapshot

    def after_backend_call(self, what: str) -> None:
        """Check that the backend call ``what`` left every pool unchanged (deferred inside a guarded
        region, skipped during a capture: :meth:`GraphLayer.replay` checks after it).

        Raises:
            PoolWritten: a pool differs from what the suite loaded.
        """
        if self._deferred is not None:
            self._deferred.append(what)
        elif not self.capturing:
            self.pool_guard.check(what)

    @contextlib.contextmanager
    def deferred_pool_checks(self):
        """Collect the pool checks of the body (a host-sync guard is active there) and make them after it."""
        outer, self._deferred = self._deferred, []
        try:
            yield
        finally:
            calls, self._deferred = self._deferred, outer
        if calls:
            self.after_backend_call(", ".join(dict.fromkeys(calls)))

    def inputs(self) -> BatchInputs:
        """The case's own batch and values."""
        return case_inputs(self.m, self.case.batch)

    # --- reloading -------------------------------------------------------------------------------

    def reload(self, slot: int, adapter: SlotAdapter | None, seed: int) -> None:
        """Load ``adapter`` (fresh values from ``seed``; layer n from its own generator) into ``slot``
        of every MoE layer's pool with ``LoRAWeights.load_slot``, or empty the slot with
        ``clear_slot`` (``adapter`` None), in place between forwards."""
        for n, (_, pool) in enumerate(self.moe_layers):
            if adapter is None:
                self.snapshot.record(n, slot, None)
                pool.clear_slot(slot)
            else:
                gen = torch.Generator(self.device).manual_seed((seed * 1_000_003 + n) % 2**63)
                modules = adapter_modules(pool.spec, adapter, gen)
                self.snapshot.record(n, slot, modules, adapter.adapter_scaling)
                pool.load_slot(slot, modules, adapter_scaling=adapter.adapter_scaling)
        self.loaded(slot)

    def load_files(self, slot: int, built, model_config) -> None:
        """Load the adapter directory ``built.path`` into ``slot`` of every MoE layer's pool through
        moelora's readers (``read_adapter`` → ``load_adapter_into_slot``), as an engine loads one;
        the snapshot records what the files mean (``built.expected``, read independently of those
        readers: :mod:`moelora_conformance.peft_files`).

        Args:
            built: a :class:`~moelora_conformance.peft_files.BuiltAdapter` with one entry per MoE layer.
            model_config: the ``MoEModelConfig`` the adapter was made for.

        Raises:
            AdapterError: whatever the reader or the slot loader refuses (the pools are unchanged).
        """
        from moelora_core.checkpoint import load_adapter_into_slot, read_adapter

        pools = [pool for _, pool in self.moe_layers]
        adapter = read_adapter(built.path, model_config, dtype=self.spec.dtype, max_rank=self.spec.R)
        load_adapter_into_slot(pools, slot, adapter, adapter_scaling=built.scaling)
        for n, modules in enumerate(built.expected):
            self.snapshot.record(n, slot, modules, built.scaling)
        self.loaded(slot)

    def loaded(self, slot: int) -> None:
        """After the suite loaded or cleared ``slot`` of the pools: take them as the guard's reference,
        call the backend's slot-load hook for each pool, and check the hook wrote none of them."""
        self.pool_version += 1
        self.pool_guard.refresh()
        for _, pool in self.moe_layers:
            notify_slot_loaded(self.backend, slot, pool)
        self.after_backend_call(f"on_slot_loaded({slot})")

    # --- the three parts ---------------------------------------------------------------------

    def _fused_layout(self, layout: str) -> tuple[dict[str, tuple[int, int]], tuple[int, ...], int]:
        """({module: (first, end) column}, guard columns, width) of the fused buffer: a guard column
        before, between and after the slices of the fused modules present; ({}, (), 0) otherwise."""
        modules = [m for m in FUSED_MODULES if m in self.spec.dense_shapes]
        if layout != "fused-qkv" or not modules:
            return {}, (), 0
        slices, guards, col = {}, [], 0
        for m in modules:
            guards.append(col)
            width = self.spec.dense_shapes[m][1]
            slices[m] = (col + 1, col + 1 + width)
            col += 1 + width
        guards.append(col)
        return slices, tuple(guards), col + 1

    def dense_base(self, dense_x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Base dense outputs (fp32 GEMM, rounded once to the case dtype), each its own tensor."""
        return {mod: (x.to(F32) @ self.m.dense_weights[mod].to(F32).T).to(self.spec.dtype)
                for mod, x in dense_x.items()}

    def projection(self, dense_x: dict[str, torch.Tensor], info: LoRABatchInfo | None) -> DenseOutputs:
        """Dense outputs, in the case's layout, with the backend's deltas added in place (none when
        ``info`` is None)."""
        out = DenseOutputs(self.dense_base(dense_x))
        if self._fused and out:
            T = next(iter(out.values())).shape[0]
            fused = torch.full((T, self._fused_width), GUARD_VALUE, dtype=self.spec.dtype, device=self.device)
            for mod, (a, b) in self._fused.items():
                fused[:, a:b].copy_(out[mod])
                out[mod] = fused[:, a:b]  # a strided view: the engine's fused qkv output
            out.fused, out.guard_columns = fused, self._guard_columns
        if info is not None:
            for mod, t in out.items():
                self.backend.dense_delta(mod, dense_x[mod], t, self.weights, info)
                self.after_backend_call(f"dense_delta({mod!r})")
        return out

    def moe(self, moe_in: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            info: LoRABatchInfo | None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, y32): MoE layer ``layer`` (0 = the first) on ``moe_in``; no LoRA when ``info`` is None
        (``deltas`` path).

        On the ``fused`` path ``info`` is required (the LoRA-disabled run passes all-base metadata).
        """
        base, weights = self.moe_layers[layer]
        if self.moe_path == "fused":
            y = self.backend.moe_forward(moe_in, topk_ids, topk_weights, base, weights, info)
            self.after_backend_call(f"moe_forward (MoE layer {layer + 1})")
            return y, None
        deltas = None if info is None else _CheckedDeltas(BackendMoEDeltas(self.backend, weights, info), self, layer)
        y32 = base_moe.moe_forward(moe_in, topk_ids, topk_weights, base, deltas=deltas,
                                   intermediate_dtype=self.intermediate_dtype, out_dtype=F32)
        return y32.to(self.spec.dtype), y32

    def extra_moe(self, y: torch.Tensor, routing, info: LoRABatchInfo | None) -> list[MoEOutput]:
        """The MoE layers after the first: layer n+1 on the RMS-normalized output of layer n
        (:func:`inter_layer_norm`) with its own routing (``routing``: per extra layer (topk_ids,
        topk_weights))."""
        out = []
        for n, (ids, w) in enumerate(routing, 1):
            x_n = inter_layer_norm(y)
            y_n, y32_n = self.moe(x_n, ids, w, info, layer=n)
            out.append(MoEOutput(x_n, y_n, y32_n))
            y = y_n
        return out

    # --- eager forwards ----------------------------------------------------------------------

    def eager(self, inp: BatchInputs, *,
              guard: Callable[[], contextlib.AbstractContextManager] | None = None) -> LayerOutput:
        """One eager forward of ``inp`` with LoRA (``prepare(batch)`` with no family).

        Args:
            guard: a context factory (e.g. ``lambda: host_sync_guard(device)``) wrapped around
                ``prepare`` + projection and around the MoE part; the break op is the harness's
                and runs outside it.
        """
        guarded = guard is not None
        guard = guard or contextlib.nullcontext
        checks = self.deferred_pool_checks if guarded else contextlib.nullcontext
        batch = inp.batch
        with checks(), guard():
            info = self.backend.prepare(batch)
            self.after_backend_call("prepare")
            if isinstance(info, Fallback):
                raise AssertionError(f"eager prepare returned {info} (eager runs never fall back)")
            dense = self.projection(inp.dense_x, info)
        breaker = LiveRequests(self.device, batch.num_tokens)
        breaker.set_batch(batch)
        moe_in = breaker(inp.x, dense)
        with checks(), guard():
            y, y32 = self.moe(moe_in, inp.topk_ids, inp.topk_weights, info)
            extra = self.extra_moe(y, inp.extra_routing, info)
        return LayerOutput(dict(dense), moe_in, y, y32, info, extra=extra, guards=dense.guards())

    def disabled(self, inp: BatchInputs, run: LayerOutput) -> LayerOutput:
        """The LoRA-disabled twin of ``run``: base dense outputs of ``inp`` and each MoE layer without
        LoRA on ``run``'s own input to that layer (so each difference is that part's LoRA delta alone)."""
        dense = self.dense_base(inp.dense_x)
        info = None
        if self.moe_path == "fused":
            info = self.backend.prepare(all_base(inp.batch))
            self.after_backend_call("prepare (all base)")
        return self.disabled_moe(run, info, inp.topk_ids, inp.topk_weights, inp.extra_routing, dense)

    def disabled_moe(self, run: LayerOutput, info: LoRABatchInfo | None, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, routing, dense: dict[str, torch.Tensor]) -> LayerOutput:
        """Every MoE layer of ``run`` without LoRA on its own input (:meth:`LayerOutput.all_rows`:
        capacity-wide in a graph run), with ``dense`` as the dense outputs."""
        full = run.all_rows()
        y, y32 = self.moe(full["moe_in"], topk_ids, topk_weights, info)
        extra = []
        for n, ((ids, w), e) in enumerate(zip(routing, full["extra"]), 1):
            y_n, y32_n = self.moe(e.moe_in, ids, w, info, layer=n)
            extra.append(MoEOutput(e.moe_in, y_n, y32_n))
        return LayerOutput(dense, full["moe_in"], y, y32, info, extra=extra)
