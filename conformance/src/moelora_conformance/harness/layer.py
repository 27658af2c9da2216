"""The layer harness: one backend on one case's layer, run eagerly (graph modes: :mod:`.graph`).

A forward is the three parts of DESIGN.md §6:

1. **projection**: for every dense module m of the spec, ``out_m = dense_x_m W_mᵀ`` (fp32, rounded
   once to the case dtype), then ``backend.dense_delta(m, dense_x_m, out_m, ...)`` in place;
2. **break op** (:mod:`.break_op`): ``moe_in = x · f(request's dense outputs)``, attention-like;
3. **MoE**: on the ``deltas`` path, the reference's vectorised base MoE
   (:mod:`moelora_reference.base_moe`) with the backend's ``moe_gate_up_delta`` (before the
   activation) and ``moe_down_delta`` (router-weighted) — intermediates in fp32, so only y is
   rounded (``y32`` keeps the fp32 sum for the delta check); on the ``fused`` path (backends that
   declare ``fused_moe``), ``backend.moe_forward``.

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
from moelora_conformance.strategies.cases import MaterializedCase, MoELoRACase
from moelora_core.backend import Backend, BackendFactory
from moelora_core.batch import BatchSpec, Request
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER
from moelora_reference import base_moe

F32 = torch.float32
#: MoE paths of the harness: the backend's delta calls around the reference base MoE, or its own
#: fused ``moe_forward``.
MOE_PATHS: tuple[str, ...] = ("deltas", "fused")


@dataclass
class LayerOutput:
    """What one forward produced, on the live rows (graph runs: the first ``T`` rows of capacity).

    Attributes:
        dense: module → [T, out] projection output with LoRA (case dtype).
        moe_in: [T, H] the break op's output, the MoE input (case dtype).
        y: [T, H] MoE output (case dtype).
        y32: [T, H] fp32 MoE output before its one rounding (``deltas`` path), else None.
        info: the metadata the run used (graph runs: the static-buffer info).
        rows: the capacity-wide tensors of a graph run (``dense``, ``moe_in``, ``y``, ``y32``) for
            checks on pad rows; equal to the live ones in eager runs.
        fallback: the ``Fallback`` a graph family returned (the run was then eager), else None.
    """

    dense: dict[str, torch.Tensor]
    moe_in: torch.Tensor
    y: torch.Tensor
    y32: torch.Tensor | None
    info: LoRABatchInfo | None
    rows: dict[str, object] = field(default_factory=dict)
    fallback: Fallback | None = None

    def live(self, T: int) -> LayerOutput:
        """The first ``T`` rows as a LayerOutput (keeping the full tensors in ``rows``)."""
        full = {"dense": self.dense, "moe_in": self.moe_in, "y": self.y, "y32": self.y32}
        return LayerOutput({m: t[:T] for m, t in self.dense.items()}, self.moe_in[:T], self.y[:T],
                           None if self.y32 is None else self.y32[:T], self.info, full, self.fallback)


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


class Layer:
    """A backend built for a case's spec, the case's weights, and eager forwards.

    Args:
        factory: the backend factory under test.
        case: the drawn case (its seed gives every value).
        device: where tensors live.
        moe_path: "deltas" or "fused" (:data:`MOE_PATHS`).
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
        self.moe_path = moe_path
        self.weights = self.m.lora

    def inputs(self) -> BatchInputs:
        """The case's own batch and values."""
        return case_inputs(self.m, self.case.batch)

    # --- the three parts ---------------------------------------------------------------------

    def dense_base(self, dense_x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Base dense outputs (fp32 GEMM, rounded once to the case dtype)."""
        return {mod: (x.to(F32) @ self.m.dense_weights[mod].to(F32).T).to(self.spec.dtype)
                for mod, x in dense_x.items()}

    def projection(self, dense_x: dict[str, torch.Tensor], info: LoRABatchInfo | None) -> dict[str, torch.Tensor]:
        """Dense outputs with the backend's deltas added in place (none when ``info`` is None)."""
        out = self.dense_base(dense_x)
        if info is not None:
            for mod, t in out.items():
                self.backend.dense_delta(mod, dense_x[mod], t, self.weights, info)
        return out

    def moe(self, moe_in: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            info: LoRABatchInfo | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, y32): the MoE layer on ``moe_in``; no LoRA when ``info`` is None (``deltas`` path).

        On the ``fused`` path ``info`` is required (the LoRA-disabled run passes all-base metadata).
        """
        if self.moe_path == "fused":
            return self.backend.moe_forward(moe_in, topk_ids, topk_weights, self.m.base, self.weights, info), None
        base = self.m.base
        gate_up_out = base_moe.gate_up(moe_in, topk_ids, base, out_dtype=F32)
        if info is not None:
            self.backend.moe_gate_up_delta(moe_in, topk_ids, gate_up_out, self.weights, info)
        h = base_moe.activation(gate_up_out)
        down_out = base_moe.down(h, topk_ids, topk_weights, base)
        if info is not None:
            self.backend.moe_down_delta(h, topk_ids, topk_weights, down_out, self.weights, info)
        y32 = base_moe.topk_sum(down_out, out_dtype=F32)
        return y32.to(self.spec.dtype), y32

    # --- eager forwards ----------------------------------------------------------------------

    def eager(self, inp: BatchInputs, *,
              guard: Callable[[], contextlib.AbstractContextManager] | None = None) -> LayerOutput:
        """One eager forward of ``inp`` with LoRA (``prepare(batch)`` with no family).

        Args:
            guard: a context factory (e.g. ``lambda: host_sync_guard(device)``) wrapped around
                ``prepare`` + projection and around the MoE part; the break op is the harness's
                and runs outside it.
        """
        guard = guard or contextlib.nullcontext
        batch = inp.batch
        with guard():
            info = self.backend.prepare(batch)
            if isinstance(info, Fallback):
                raise AssertionError(f"eager prepare returned {info} (eager runs never fall back)")
            dense = self.projection(inp.dense_x, info)
        breaker = LiveRequests(self.device, batch.num_tokens)
        breaker.set_batch(batch)
        moe_in = breaker(inp.x, dense)
        with guard():
            y, y32 = self.moe(moe_in, inp.topk_ids, inp.topk_weights, info)
        return LayerOutput(dense, moe_in, y, y32, info)

    def disabled(self, inp: BatchInputs, run: LayerOutput) -> LayerOutput:
        """The LoRA-disabled twin of ``run``: base dense outputs of ``inp`` and the MoE without LoRA
        on ``run``'s own MoE input (so the difference is the MoE's LoRA delta alone)."""
        dense = self.dense_base(inp.dense_x)
        info = self.backend.prepare(all_base(inp.batch)) if self.moe_path == "fused" else None
        y, y32 = self.moe(run.moe_in, inp.topk_ids, inp.topk_weights, info)
        return LayerOutput(dense, run.moe_in, y, y32, info)
