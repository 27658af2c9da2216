"""Histories: the batches a backend ran before the batch a property checks (properties 2 and 4).

A history is 1-3 steps drawn from :data:`STEP_KINDS`, each a batch on the case's adapter pool with
fresh values:

- ``adapters``: a random batch of adapter and base requests;
- ``all_base``: every request on ``NO_ADAPTER``;
- ``idle``: an IDLE batch (zero tokens);
- ``larger``: more requests than the checked batch (in graph modes: its tails are what a stale
  reset would replay);
- ``other_family``: a batch prepared and replayed in the *other* graph family of the same backend
  (eager mode: any declared family), which must not disturb this one.

Graph modes may also *interleave* an other-family batch between the checked batch's ``prepare`` and
its replay (as a scheduler that prepares a decode and a prefill step before running either): the
replay must still read exactly what its own ``prepare`` wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from moelora_conformance.harness import BatchInputs, GraphLayer, LayerOutput, derive_inputs
from moelora_conformance.properties.support import Capacity, Subject, Suite, capacity_for, trace
from moelora_conformance.strategies.cases import MaterializedCase, MoELoRACase
from moelora_conformance.strategies.suite import family_of, mode_forward, pool_batches, tokens_per_request
from moelora_core.batch import BatchSpec
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode

STEP_KINDS: tuple[str, ...] = ("adapters", "all_base", "idle", "larger", "other_family")


@dataclass
class Step:
    """One history step: its kind, the mode it runs in, and its inputs."""

    kind: str
    mode: str
    inputs: BatchInputs
    interleaved: bool = False


def other_family_mode(suite: Suite, mode: str) -> str | None:
    """The harness mode of the other graph family (None when the backend declares none)."""
    declared = suite.capabilities.graph_families
    family = family_of(mode)
    prefill_mode = next((f"prefill-{m}" for m in ("full", "breakable") if m in suite.capabilities.prefill_graph_modes),
                        None)
    if family != "decode" and "decode" in declared:
        return "decode"
    if family != "prefill" and "prefill" in declared and prefill_mode is not None:
        return prefill_mode
    return None


def _request_limit(suite: Suite, mode: str, tpr: int) -> int:
    caps = suite.caps
    return max(1, min(caps.max_requests, caps.max_tokens // tpr))


def draw_batch(data: st.DataObject, suite: Suite, like: BatchSpec, mode: str, *, min_requests: int = 1,
               adapters: str = "mixed", label: str) -> BatchSpec:
    """A batch for ``mode`` on ``like``'s pool, with at least ``min_requests`` requests where the caps
    allow (decode: ``like``'s tokens per request)."""
    fmode = mode_forward(mode, like)
    tpr = tokens_per_request(like) if fmode is ForwardMode.DECODE else 1
    limit = _request_limit(suite, mode, tpr)
    n = data.draw(st.integers(min(min_requests, limit), limit), label=f"{label}: requests")
    return data.draw(pool_batches(like, fmode, n, max_tokens=suite.caps.max_tokens, tokens_per_request=tpr,
                                  adapters=adapters), label=label)


def draw_history(data: st.DataObject, suite: Suite, case: MoELoRACase, m: MaterializedCase, mode: str,
                 target: BatchSpec, *, interleave: bool = False) -> list[Step]:
    """1-3 history steps before ``target`` (see the module docstring), and with ``interleave`` a last
    other-family step run between ``target``'s prepare and replay (:meth:`HistoryRunner.interleaved`)."""
    other = other_family_mode(suite, mode)
    kinds = [k for k in STEP_KINDS if k != "other_family" or other is not None]
    n = data.draw(st.integers(1, 3), label="history length")
    steps = []
    for i in range(n):
        kind = data.draw(st.sampled_from(kinds), label=f"history step {i}")
        step_mode = other if kind == "other_family" else mode
        if kind == "idle":
            batch = BatchSpec(ForwardMode.IDLE, (), target.max_loras, target.lora_ranks, target.scalings)
        elif kind == "larger":
            batch = draw_batch(data, suite, target, mode, min_requests=target.bs + 1, label=f"history batch {i}")
        elif kind == "other_family":
            like = target if (step_mode == "decode") == (target.forward_mode is ForwardMode.DECODE) else BatchSpec(
                ForwardMode.IDLE, (), target.max_loras, target.lora_ranks, target.scalings)
            batch = draw_batch(data, suite, like, step_mode, label=f"history batch {i}")
        else:
            batch = draw_batch(data, suite, target, mode, adapters=kind if kind == "all_base" else "mixed",
                               label=f"history batch {i}")
        inputs = derive_inputs(case, m, batch, seed=case.seed * 7 + 1 + i)
        steps.append(Step(kind, step_mode, inputs))
        trace(f"history step {i} ({kind}, {step_mode}): {inputs.describe()}")
    if interleave:
        other_mode = other_family_mode(suite, mode)
        idle = BatchSpec(ForwardMode.IDLE, (), target.max_loras, target.lora_ranks, target.scalings)
        batch = draw_batch(data, suite, idle, other_mode, adapters="adapters", label="interleaved batch")
        inputs = derive_inputs(case, m, batch, seed=case.seed * 7 + 97)
        steps.append(Step("other_family", other_mode, inputs, interleaved=True))
        trace(f"interleaved between prepare and replay ({other_mode}): {inputs.describe()}")
    return steps


class HistoryRunner:
    """Runs a history on a subject: its own mode's steps through the subject, other-family steps
    through a second graph layer on the same backend."""

    def __init__(self, subject: Subject, steps: list[Step]) -> None:
        self.subject = subject
        self.steps = steps
        others = [s for s in steps if s.mode != subject.mode]
        self.other: GraphLayer | None = None
        if others:
            mode = others[0].mode
            cap: Capacity = capacity_for(mode, [s.inputs.batch for s in others])
            self.other = GraphLayer(subject.layer, mode, max_requests=cap.max_requests, max_tokens=cap.max_tokens,
                                    tokens_per_request=cap.tokens_per_request, pad_seed=subject.case.seed + 5)

    def run(self) -> None:
        """Run every step but the interleaved one, in order."""
        for step in self.steps:
            if step.interleaved:
                continue
            if step.mode == self.subject.mode:
                self.subject.run(step.inputs)
            else:
                self._run_other(step)

    def _run_other(self, step: Step) -> None:
        out = self.other.run(step.inputs)
        if out.fallback is not None:
            raise AssertionError(f"{step.mode}: prepare returned {out.fallback} within capacity")

    def interleaved(self, inp: BatchInputs) -> LayerOutput:
        """Stage ``inp`` in the subject's graph, run the interleaved other-family step, then replay
        ``inp`` — whose static buffers the other family must not have touched."""
        step = next(s for s in self.steps if s.interleaved)
        info = self.subject.graph.stage(inp)
        if isinstance(info, Fallback):
            raise AssertionError(f"{self.subject.mode}: prepare returned {info} within capacity")
        self._run_other(step)
        return self.subject.graph.replay()


def history_capacity(mode: str, target: BatchSpec, steps: list[Step], extra_requests: int = 0,
                     extra_tokens: int = 0) -> Capacity:
    """The subject's capacity: every own-mode batch of the history and the target fit."""
    own = [s.inputs.batch for s in steps if s.mode == mode] + [target]
    return capacity_for(mode, own, extra_requests=extra_requests, extra_tokens=extra_tokens)


def draw_history_capacity(data: st.DataObject, mode: str, target: BatchSpec, steps: list[Step]) -> Capacity | None:
    """:func:`history_capacity` with drawn slack (0-2 requests, 0-8 tokens), traced; None (nothing
    drawn) in eager mode."""
    if mode == "eager":
        return None
    capacity = history_capacity(mode, target, steps, data.draw(st.integers(0, 2), label="request slack"),
                                data.draw(st.integers(0, 8), label="token slack"))
    trace(f"capacity: {capacity}")
    return capacity
