"""Histories: the batches a backend ran before the batch a property checks (properties 2 and 4).

A history is 1-3 steps drawn from :data:`STEP_KINDS`, each a batch on the adapter pool as the
history has left it, with fresh values — or a reload of the pool:

- ``adapters``: a random batch of adapter and base requests;
- ``all_base``: every request on ``NO_ADAPTER``;
- ``idle``: an IDLE batch (zero tokens);
- ``larger``: more requests than the checked batch (in graph modes: its tails are what a stale
  reset would replay);
- ``other_family``: a batch prepared and replayed in the *other* graph family of the same backend
  (eager mode: any declared family), which must not disturb this one;
- ``reload``: another adapter loaded into a slot the checked batch uses (slot reuse, eviction) —
  fresh values, mostly rank R (larger than any rank the pool held), another σ — or new weights of the
  slot's own config (RL weight sync), or the slot emptied with ``clear_slot``
  (:func:`draw_reload`); through ``LoRAWeights.load_slot`` / ``clear_slot`` between
  batches, exactly as an engine does it (:meth:`~moelora_conformance.harness.Layer.reload`). A
  reload always follows a batch with LoRA in the subject's mode: in graph modes the graph is then
  captured *before* the reload and replayed after it, and a backend that caches factors, σ or a
  rank bound on first use is caught holding the old ones. Every later batch — the checked one
  included — describes the pool as it is now (ranks and σ of ``BatchSpec``), as a scheduler's.
- ``hot_load``: an adapter loaded into a slot the checked batch uses that was empty when the
  subject's first batch ran (graph modes: its capture) and is empty now — emptied first when nothing
  has run yet; a slot an earlier hot load filled gets a ``reload`` instead —
  as a server loads an adapter on demand into a slot no graph bucket saw in use; a backend whose
  graph keeps the empty slot's flags or pointers of capture time serves that slot no LoRA.

Graph modes may also *interleave* an other-family batch between the checked batch's ``prepare`` and
its replay (as a scheduler that prepares a decode and a prefill step before running either): the
replay must still read exactly what its own ``prepare`` wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from moelora_conformance.harness import BatchInputs, GraphLayer, LayerOutput, derive_inputs
from moelora_conformance.properties.support import Subject, Suite, capacity_for, trace
from moelora_conformance.strategies.adapters import SlotAdapter, pool_ranks, pool_scalings, slot_adapters
from moelora_conformance.strategies.cases import MaterializedCase, MoELoRACase
from moelora_conformance.strategies.choice import uniform, weighted
from moelora_conformance.strategies.suite import family_of, mode_forward, pool_batches, tokens_per_request
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec, Request
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode

#: The simplest history (the first example Hypothesis tries) is one reload after a batch with LoRA:
#: "reload" comes first.
STEP_KINDS: tuple[str, ...] = ("reload", "hot_load", "adapters", "all_base", "idle", "larger", "other_family")
#: Draw weights of the step kinds (others 1): a reload or a hot load in most histories. Hypothesis
#: builds most examples from earlier ones, so 60 examples hold about ten independent draws of a
#: choice: the weights here and in draw_reload keep every reload kind in the 60 examples of
#: test_histories_reload_used_slots_after_a_lora_batch under other seeds too.
_KIND_WEIGHTS = {"reload": 4.0, "hot_load": 3.0}


@dataclass(frozen=True)
class Reload:
    """A reload step: ``adapter`` (None: ``clear_slot``) into ``slot``, values from ``seed``."""

    slot: int
    adapter: SlotAdapter | None
    seed: int
    same_config: bool = False  # new weights of the slot's own config (RL weight sync)

    def applied(self, pool: tuple[SlotAdapter | None, ...]) -> tuple[SlotAdapter | None, ...]:
        """The pool's structure after this reload."""
        return tuple(self.adapter if s == self.slot else a for s, a in enumerate(pool))

    def describe(self) -> str:
        a = self.adapter
        what = "clear_slot" if a is None else f"load_slot {a.describe()} σ={a.adapter_scaling:.6g}"
        return f"slot {self.slot}: {what} (seed {self.seed}{', same config: new weights' if self.same_config else ''})"

    def with_slot_used(self, batch: BatchSpec) -> BatchSpec:
        """``batch`` with its first request on this reload's slot (unchanged for a clear or an empty
        batch): a batch after a hot load or a same-config reload reads the reloaded slot."""
        if self.adapter is None or not batch.requests:
            return batch
        first = batch.requests[0]
        requests = (Request(self.slot, first.extend_len, first.prefix_len), *batch.requests[1:])
        return BatchSpec(batch.forward_mode, requests, batch.max_loras, batch.lora_ranks, batch.scalings)


@dataclass
class Step:
    """One history step: its kind, the mode it runs in, and its inputs (None for a reload)."""

    kind: str
    mode: str
    inputs: BatchInputs | None
    interleaved: bool = False
    reload: Reload | None = None


@dataclass
class History:
    """A drawn history and what it leaves: ``case`` is the drawn case with the pool as the reloads
    left it and its batch re-described on that pool (same requests)."""

    steps: list[Step]
    case: MoELoRACase


def on_pool(batch: BatchSpec, pool: tuple[SlotAdapter | None, ...]) -> BatchSpec:
    """``batch``'s requests on ``pool`` (its per-slot ranks and σ), as a scheduler describes a batch
    after a reload."""
    return BatchSpec(batch.forward_mode, batch.requests, batch.max_loras, pool_ranks(pool), pool_scalings(pool))


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


def draw_rank_headroom(data: st.DataObject, suite: Suite, case: MoELoRACase) -> MoELoRACase:
    """``case``, or (drawn, where the caps allow) ``case`` with the pool's R raised to the caps' — past
    every rank its adapters hold, as a server's max LoRA rank usually is — so a reload can bring an
    adapter of a larger rank than any the pool held when a graph was captured."""
    most = max((a.slot_rank for a in case.pool if a is not None), default=0)
    # True first: the simplest example raises R (a later reload can then pass any rank captured with)
    if most >= suite.caps.max_rank or not data.draw(uniform((True, False)), label="R past the pool's ranks"):
        return case
    trace(f"R raised to {suite.caps.max_rank} (the pool's largest rank is {most})")
    return replace(case, shape=replace(case.shape, max_rank=suite.caps.max_rank))


def draw_reload(data: st.DataObject, case: MoELoRACase, pool: tuple[SlotAdapter | None, ...], slots: list[int],
                *, seed: int, label: str) -> Reload:
    """A reload of one of ``slots`` (any slot if empty): a new adapter of rank R (three times in four:
    larger than any the pool held, where R allows) or a drawn rank, with another σ than the slot's
    adapter — half the time targeting only some of the modules the slot's adapter had (slot reuse
    by an adapter that lacks modules: none of the old one's may remain) — or, if the slot holds one,
    ``clear_slot`` (one time in four) or new weights of the slot's own config (one time in four: the
    same modules, ranks and σ, fresh values, as RL weight sync reloads a name every training step with
    ``load_adapter_from_tensors``; a backend that keys a copy or a cache on the slot's ranks and σ
    keeps the old weights). The simplest draw loads an adapter of rank R."""
    shape = case.shape
    slot = data.draw(uniform(sorted(slots) or list(range(shape.max_loras))), label=f"{label}: slot")
    old = pool[slot]
    if old is not None:
        how = data.draw(weighted([("another adapter", 2), ("clear", 1), ("same config", 1)]), label=f"{label}: kind")
        if how == "clear":
            return Reload(slot, None, seed)
        if how == "same config":
            return Reload(slot, old, seed, same_config=True)
    rank_r = data.draw(weighted([(True, 3), (False, 1)]), label=f"{label}: rank R")
    adapter = data.draw(slot_adapters(shape, ranks=st.just(shape.max_rank) if rank_r else None,
                                      exclude_sigma=None if old is None else old.adapter_scaling),
                        label=f"{label}: adapter")
    if old is not None and len(old.modules) > 1 and data.draw(st.booleans(), label=f"{label}: fewer modules"):
        had = [m for m, _, _ in old.modules]
        keep = data.draw(st.lists(uniform(had), min_size=1, max_size=len(had) - 1, unique=True),
                         label=f"{label}: modules kept")
        adapter = replace(adapter, modules=tuple((m, adapter.rank, adapter.alpha) for m in had if m in keep))
    return Reload(slot, adapter, seed)


def draw_history(data: st.DataObject, suite: Suite, case: MoELoRACase, m: MaterializedCase, mode: str,
                 target: BatchSpec, *, interleave: bool = False) -> History:
    """1-3 history steps before ``target`` (see the module docstring), and with ``interleave`` a last
    other-family step run between ``target``'s prepare and replay (:meth:`HistoryRunner.interleaved`)."""
    other = other_family_mode(suite, mode)
    kinds = [k for k in STEP_KINDS if k != "other_family" or other is not None]
    n = data.draw(st.integers(1, 3), label="history length")
    pool = case.pool
    steps: list[Step] = []
    lora_ran = False  # a batch with LoRA ran in the subject's mode (graph modes: the graph is captured)
    captured: tuple[SlotAdapter | None, ...] | None = None  # the pool when the subject's first batch ran
    used = sorted({r.slot for r in target.requests if r.slot >= 0})  # slots the checked batch uses

    def add_batch(kind: str, step_mode: str, batch: BatchSpec, i: int) -> None:
        nonlocal lora_ran, captured
        inputs = derive_inputs(case, m, batch, seed=case.seed * 7 + 1 + i)
        steps.append(Step(kind, step_mode, inputs))
        lora_ran = lora_ran or (step_mode == mode and batch.has_active_lora)
        captured = pool if captured is None and step_mode == mode else captured
        trace(f"history step {i} ({kind}, {step_mode}): {inputs.describe()}")

    def add_reload(reload: Reload, i: int, what: str = "reload") -> None:
        nonlocal pool
        kind = {"emptied before the capture": "empty_before_capture", "hot load after the capture": "hot_load"}
        steps.append(Step(kind.get(what, "reload"), mode, None, reload=reload))
        pool = reload.applied(pool)
        trace(f"history step {i} ({what}): {reload.describe()}")

    for i in range(n):
        kind = data.draw(weighted([(k, _KIND_WEIGHTS.get(k, 1.0)) for k in kinds]), label=f"history step {i}")
        now = on_pool(target, pool)
        step_mode = other if kind == "other_family" else mode
        if kind == "hot_load":
            # a load into a slot the checked batch uses that no adapter held when the subject's graph
            # was captured (its first batch) and none holds now — emptied first if nothing ran yet —
            # after a batch with LoRA where the pool has any (the capture, and what a backend's cache
            # primes on; with the pool empty, a capture with no adapter loaded, as at a server's start)
            hot = [s for s in used if captured is not None and captured[s] is None and pool[s] is None]
            if captured is None or hot:
                slot = data.draw(uniform(hot or used or list(range(case.shape.max_loras))),
                                 label=f"history step {i}: hot-loaded slot")
                if captured is None and pool[slot] is not None:
                    add_reload(Reload(slot, None, case.seed * 7 + 40 + i), i, "emptied before the capture")
                if captured is None or (not lora_ran and any(pool)):
                    batch = draw_batch(data, suite, on_pool(target, pool), mode, adapters="adapters",
                                       label=f"history batch {i} before the hot load")
                    add_batch("adapters", mode, batch, 10 + i)
                # the slot is empty: draw_reload loads an adapter (never a clear or a same-config reload)
                reload = draw_reload(data, case, pool, [slot], seed=case.seed * 7 + 50 + i,
                                     label=f"history hot load {i}")
                add_reload(reload, i, "hot load after the capture")
                continue
            # every slot the checked batch uses held an adapter at the capture, or holds one now (an
            # earlier hot load's): a reload of it
            kind = "reload"
        if kind == "reload":
            if not lora_ran:
                batch = draw_batch(data, suite, now, mode, adapters="adapters",
                                   label=f"history batch {i} before reload")
                add_batch("adapters", mode, batch, 10 + i)
            reload = draw_reload(data, case, pool, used, seed=case.seed * 7 + 50 + i, label=f"history reload {i}")
            add_reload(reload, i)
            continue
        if kind == "idle":
            batch = BatchSpec(ForwardMode.IDLE, (), now.max_loras, now.lora_ranks, now.scalings)
        elif kind == "larger":
            batch = draw_batch(data, suite, now, mode, min_requests=target.bs + 1, label=f"history batch {i}")
        elif kind == "other_family":
            like = now if (step_mode == "decode") == (target.forward_mode is ForwardMode.DECODE) else BatchSpec(
                ForwardMode.IDLE, (), now.max_loras, now.lora_ranks, now.scalings)
            batch = draw_batch(data, suite, like, step_mode, label=f"history batch {i}")
        else:
            batch = draw_batch(data, suite, now, mode, adapters=kind if kind == "all_base" else "mixed",
                               label=f"history batch {i}")
        add_batch(kind, step_mode, batch, i)
    now = on_pool(target, pool)
    if interleave:
        other_mode = other_family_mode(suite, mode)
        idle = BatchSpec(ForwardMode.IDLE, (), now.max_loras, now.lora_ranks, now.scalings)
        batch = draw_batch(data, suite, idle, other_mode, adapters="adapters", label="interleaved batch")
        inputs = derive_inputs(case, m, batch, seed=case.seed * 7 + 97)
        steps.append(Step("other_family", other_mode, inputs, interleaved=True))
        trace(f"interleaved between prepare and replay ({other_mode}): {inputs.describe()}")
    return History(steps, replace(case, pool=pool, plan=replace(case.plan, batch=now)))


class HistoryRunner:
    """Runs a history on a subject: its own mode's steps through the subject, other-family steps
    through a second graph layer on the same backend."""

    def __init__(self, subject: Subject, steps: list[Step]) -> None:
        self.subject = subject
        self.steps = steps
        others = [s for s in steps if s.mode != subject.mode and s.inputs is not None]
        self.other: GraphLayer | None = None
        if others:
            mode = others[0].mode
            cap: GraphCapacity = capacity_for(mode, [s.inputs.batch for s in others])
            self.other = GraphLayer(subject.layer, mode, max_requests=cap.max_requests, max_tokens=cap.max_tokens,
                                    tokens_per_request=cap.tokens_per_request, pad_seed=subject.case.seed + 5)

    def run(self) -> None:
        """Run every step but the interleaved one, in order."""
        for step in self.steps:
            if step.interleaved:
                continue
            if step.reload is not None:
                r = step.reload
                self.subject.layer.reload(r.slot, r.adapter, r.seed)
            elif step.mode == self.subject.mode:
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
                     extra_tokens: int = 0) -> GraphCapacity:
    """The subject's capacity: every own-mode batch of the history and the target fit."""
    own = [s.inputs.batch for s in steps if s.mode == mode and s.inputs is not None] + [target]
    return capacity_for(mode, own, extra_requests=extra_requests, extra_tokens=extra_tokens)


def draw_history_capacity(data: st.DataObject, mode: str, target: BatchSpec,
                          steps: list[Step]) -> GraphCapacity | None:
    """:func:`history_capacity` with drawn slack (0-2 requests, 0-8 tokens), traced; None (nothing
    drawn) in eager mode."""
    if mode == "eager":
        return None
    capacity = history_capacity(mode, target, steps, data.draw(st.integers(0, 2), label="request slack"),
                                data.draw(st.integers(0, 8), label="token slack"))
    trace(f"capacity: {capacity}")
    return capacity
