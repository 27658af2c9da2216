"""The e2e properties E01-E05 (:mod:`.properties`) checked on served runs of the workload
(:class:`~.workload.Served`), each returning :class:`~.results.E2EResult` records.

The capacity a step is held to (E03 / E04) comes from the e2e's own engine settings
(:class:`Capacity`), not from the engine's bucket choice: a prefill step fits when its requests fit
the request slots of the largest prefill bucket (``min(max_num_requests, largest)``: a small bucket
has at most one slot per token) and its tokens fit the largest bucket; a decode step when its
requests fit the largest decode bucket. A step over both limits may carry either reason.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moelora_conformance.e2e.engine_checks import HFReference, check_against_hf, compare_outputs
from moelora_conformance.e2e.results import E2EResult, checking
from moelora_conformance.e2e.workload import Served, StepRecord, Workload


@dataclass(frozen=True)
class Capacity:
    """What the graph engines of a run captured: the largest prefill bucket (tokens), the prefill
    graph's request slots, the largest decode bucket (requests)."""

    prefill_tokens: int
    prefill_requests: int
    decode_requests: int

    def expected(self, step: StepRecord, mode: str) -> set[tuple[str, str]]:
        """The (mode, reason) labels ``step`` may carry in engine mode ``mode``."""
        if step.phase == "idle":
            return {("eager", "disabled")}
        if step.phase == "decode":
            if mode == "eager":
                return {("eager", "disabled")}
            return {("eager", "over_requests")} if step.requests > self.decode_requests else {("decode_graph", "")}
        if mode in ("eager", "decode_graph"):
            return {("eager", "disabled")}
        over = set()
        if step.requests > min(self.prefill_requests, self.prefill_tokens):
            over.add(("eager", "over_requests"))
        if step.tokens > self.prefill_tokens:
            over.add(("eager", "over_tokens"))
        return over or {(mode, "")}


def _step_text(i: int, step: StepRecord) -> str:
    mode, reason = step.label
    return f"step {i} ({step.phase}, {step.requests} requests, {step.tokens} tokens) ran {mode}/{reason!r}"


def check_graph_paths(base: E2EResult, served: Served, capacity: Capacity, *, last_fallback=None) -> list[E2EResult]:
    """E03 (every step that fits ran on its graph) and E04 (every step beyond capacity ran eagerly with
    its reason; at least one such step, else E04 is ``not_run``: nothing exercised it)."""
    mode = base.mode
    fits, beyond = _like(base, "E03"), _like(base, "E04")
    wrong_fit, wrong_over, n_fit, n_over = [], [], 0, 0
    for i, step in enumerate(served.steps):
        if step.phase == "idle":
            continue
        allowed = capacity.expected(step, mode)
        graph = any(reason == "" for _, reason in allowed) or ("eager", "disabled") in allowed
        if graph:
            n_fit += 1
            if step.label not in allowed:
                wrong_fit.append(f"{_step_text(i, step)}, expected {sorted(allowed)}")
        else:
            n_over += 1
            if step.label not in allowed:
                wrong_over.append(f"{_step_text(i, step)}, expected one of {sorted(allowed)}")
    counts = {"/".join((s.phase, *s.label)): 0 for s in served.steps}
    for s in served.steps:
        counts["/".join((s.phase, *s.label))] += 1
    details = dict(steps=len(served.steps), passes=counts)
    if wrong_fit:
        extra = f"; the last fallback: {last_fallback}" if last_fallback else ""
        fits.failed(f"{len(wrong_fit)} of {n_fit} steps that fit did not run on their graph: {wrong_fit[0]}{extra}",
                    wrong=wrong_fit[:10], **details)
    else:
        fits.passed(fitting_steps=n_fit, **details)
    if wrong_over:
        beyond.failed(f"{len(wrong_over)} of {n_over} steps beyond capacity: {wrong_over[0]}", wrong=wrong_over[:10],
                      **details)
    elif n_over == 0:
        work = [s for s in served.steps if s.phase != "idle"]
        most = (f"the largest step: {max(s.requests for s in work)} requests, {max(s.tokens for s in work)} tokens"
                if work else "no step ran")
        cap = (f"decode graph: {capacity.decode_requests} requests; prefill graph: {capacity.prefill_tokens} tokens, "
               f"{capacity.prefill_requests} requests")
        beyond.not_run(f"no step of this run was beyond the captured capacity ({cap}; {most}): more requests "
                       "(--requests) or a smaller capacity (--decode-batch-buckets, --prefill-token-buckets, "
                       "--max-num-requests) exercise it")
    else:
        beyond.passed(steps_beyond=n_over, **details)
    return [fits, beyond]


def check_graph_vs_eager(base: E2EResult, served: Served, eager: Served, *, dtype: str,
                         record_path=None, base_quant: str = "none") -> E2EResult:
    """E01: the graph mode's outputs against the eager run's (``graph_vs_eager``, over ``base_quant``'s
    rows); ``not_run`` where the tolerance policy has no row for ``dtype`` (a comparison nobody measured
    has no bound)."""
    from moelora_core import logprob_tolerance

    try:
        logprob_tolerance("graph_vs_eager", dtype, base_quant=base_quant)
    except KeyError as exc:
        return _like(base, "E01").not_run(str(exc).strip("'\""))
    with checking(_like(base, "E01")) as r:
        worst, mean = compare_outputs(served.outputs, eager.outputs, what=f"{base.backend} {base.mode} vs eager",
                                      dtype=dtype, record_path=record_path, base_quant=base_quant,
                                      record=dict(backend=base.backend, mode=base.mode, model=base.model, suite="e2e"))
        r.passed(max_abs=worst, mean_abs=mean, requests=len(served.outputs))
    return r


def check_hf(base: E2EResult, served: Served, workload: Workload, hf: HFReference | None, *, dtype: str,
             why_not: str = "") -> E2EResult:
    """E02: every request against HF + PEFT with its adapter (``engine_vs_hf`` row of ``dtype``)."""
    r = _like(base, "E02")
    if hf is None:
        return r.not_run(why_not or "HF + PEFT not available")
    with checking(r):
        # a request added after its adapter's same-config reload is checked against the reloaded weights
        requests = [dict(q, adapter=served.reference.get(q["request_id"], q.get("adapter"))) for q in workload.requests]
        got = check_against_hf(served.outputs, requests, hf, dtype=dtype,
                               what=f"{base.backend} {base.mode} vs HF+PEFT")
        r.passed(**got)
    return r


#: The number of requests E05's claim names ("64 ragged requests").
CLAIM_REQUESTS = 64
#: E05's coverage items: id → what the claim says the run includes.
WORKLOAD_ITEMS: dict[str, str] = {
    "requests": f"{CLAIM_REQUESTS} ragged requests",
    "ranks": ">= 3 adapter ranks",
    "rslora": "an rsLoRA adapter",
    "per_expert": "a legacy per-expert adapter",
    "base": "base requests",
    "mixed": "prefills and decodes in one step",
    "evicted": "slots evicted and reused",
    "pattern": "an adapter with layer-specific rank_pattern and alpha_pattern",
    "reload": "a same-config reload (new weights of a name) served",
    "guard": "every step under the host-sync guard",
    "graph_chunks": "first, middle and last prompt chunks on the prefill graph, next to decodes",
    "relayout": "a prefill-graph bucket replayed on the same requests and slots with a changed chunk layout",
    "hot_load": "a graph bucket replayed with an adapter in a slot that was empty at its capture",
}
#: The items an adapter meets (only an adapter that is not a no-op meets one).
ADAPTER_ITEMS: tuple[str, ...] = ("ranks", "rslora", "per_expert", "pattern")
#: The engine modes each graph item applies to (the others run no such graph).
GRAPH_ITEMS: dict[str, tuple[str, ...]] = {"graph_chunks": ("full", "breakable"), "relayout": ("full", "breakable"),
                                           "hot_load": ("decode_graph", "full", "breakable")}


def graph_coverage(steps: list[StepRecord]) -> dict[str, object]:
    """What the prefill and decode graphs replayed (E05's graph items): the chunk kinds run on the
    prefill graph in a step with decodes, the prefill-graph steps that replayed the previous step's
    bucket on the same requests and slots with a changed chunk layout, and the graph steps with a
    request in a slot that was empty at its bucket's capture."""
    graph = [s for s in steps if s.bucket is not None]
    chunks = set().union(*(s.chunks for s in graph if s.phase == "prefill" and s.decode_items)) if graph else set()
    relayouts = sum(1 for a, b in itertools.pairwise(steps)
                    if a.phase == b.phase == "prefill" and a.bucket is not None and a.bucket == b.bucket
                    and a.same_slots(b) and not a.same_layout(b) and (a.chunks or b.chunks))
    return dict(graph_steps=len(graph), graph_chunks=sorted(chunks), relayouts=relayouts,
                hot_steps=sum(1 for s in graph if s.hot))


def not_applicable_items(family: str) -> dict[str, str]:
    """E05 adapter items that ``family`` (a transformers ``model_type``) cannot meet, with the reason: an
    item is never met by an adapter E02 cannot check against HF + PEFT.

    Qwen2-MoE: peft 0.21.2 does not apply legacy per-expert adapters to it (it drops their expert keys,
    ``moelora_conformance.checkpoint_pass.adapters.PEFT_UNCONVERTED_LEGACY``); GPT-OSS: transformers never
    held its experts as per-expert modules, so no legacy adapter of it exists.
    """
    from moelora_conformance.checkpoint_pass.adapters import NO_LEGACY_PASS, PEFT_UNCONVERTED_LEGACY

    if family in PEFT_UNCONVERTED_LEGACY:
        return {"per_expert": f"not applicable on {family}: peft 0.21.2 does not apply legacy per-expert adapters "
                              "to it, so E02 could not check one"}
    if family in NO_LEGACY_PASS:
        return {"per_expert": f"not applicable on {family}: no legacy per-expert adapter of it exists"}
    return {}


def check_workload(base: E2EResult, served: Served, workload: Workload, *, adapter_kinds: dict[str, dict],
                   max_loras: int, n: int, max_prompt_tokens: int, family: str = "",
                   noop: frozenset[str] = frozenset(), mode: str = "eager") -> E2EResult:
    """E05: the run exercised what the workload claims (module doc of :mod:`.properties`).

    Each of :data:`WORKLOAD_ITEMS` is "met", "not met (what the run had)" or, for the items
    :func:`not_applicable_items` names for ``family``, "not applicable ..." with the reason. Every item
    met or not applicable: passed; otherwise ``partial``, the unmet items in the message and in
    ``coverage`` (a run of 16 requests with two adapter ranks is not the claim's workload, and says so).
    The workload itself must be what was asked (``n`` requests, prompts 1 .. ``max_prompt_tokens``):
    otherwise the claim failed.

    Args:
        adapter_kinds: adapter name → {"rank": int, "rslora": bool, "per_expert": bool, "pattern": bool}.
        family: the model's ``model_type``. mode: the engine mode served (the graph items of
            :data:`GRAPH_ITEMS` are "not applicable" in the modes without that graph).
        noop: the adapters that are no-ops (``moelora_core.checkpoint.adapter_effect``): they meet no
            adapter item.
    """
    with checking(_like(base, "E05")) as r:
        lengths = [len(q["prompt_token_ids"]) for q in workload.requests]
        used = {q.get("adapter") for q in workload.requests}
        effective = sorted(a for a in used if a is not None and a not in noop)
        ranks = {adapter_kinds[a]["rank"] for a in effective}
        kinds = dict(ranks=sorted(ranks), rslora=any(adapter_kinds[a]["rslora"] for a in effective),
                     per_expert=any(adapter_kinds[a]["per_expert"] for a in effective),
                     pattern=any(adapter_kinds[a].get("pattern") for a in effective))
        graphs = graph_coverage(served.steps)
        work = [s for s in served.steps if s.phase != "idle"]
        unguarded = sum(1 for s in work if not s.guarded)
        mixed = sum(1 for s in served.steps if s.prefill_items and s.decode_items)
        prefills = [s.tokens for s in served.steps if s.phase == "prefill"]
        chunked = bool(prefills) and max(lengths) > max(prefills)
        assert len(workload.requests) == n, f"the workload has {len(workload.requests)} requests, not {n}"
        assert min(lengths) == 1 and max(lengths) == max_prompt_tokens, \
            f"prompt lengths {min(lengths)}..{max(lengths)}, not 1..{max_prompt_tokens}"
        noop_used = sorted(a for a in used if a in noop)
        only_noop = f"; no-op adapters {noop_used} do not count" if noop_used else ""
        met = {
            "requests": (n >= CLAIM_REQUESTS, f"{n} requests"),
            "ranks": (len(ranks) >= 3, f"ranks {sorted(ranks)}{only_noop}"),
            "rslora": (kinds["rslora"], f"none{only_noop}"),
            "per_expert": (kinds["per_expert"], f"none{only_noop}"),
            "base": (None in used, "none"),
            "mixed": (mixed > 0, "no such step"),
            "evicted": (served.evictions > 0 and served.loads > max_loras,
                        f"{served.loads} loads, {served.evictions} evictions, {max_loras} slots"),
            "pattern": (kinds["pattern"], f"none{only_noop}"),
            "reload": (served.reloads > 0 and served.reloaded_requests > 0,
                       f"{served.reloads} reloads, {served.reloaded_requests} requests after one"),
            "guard": (bool(work) and unguarded == 0, f"{unguarded} of {len(work)} steps unguarded"),
            "graph_chunks": ({"first", "middle", "last"} <= set(graphs["graph_chunks"]),
                             f"chunks {graphs['graph_chunks']} on the prefill graph next to decodes"),
            "relayout": (graphs["relayouts"] > 0, "no such pair of steps"),
            "hot_load": (graphs["hot_steps"] > 0, f"{graphs['graph_steps']} graph steps, none such"),
        }
        exempt = not_applicable_items(family)
        exempt.update({item: f"not applicable in mode {mode}: no such graph" for item, modes in GRAPH_ITEMS.items()
                       if mode not in modes})
        coverage = {item: exempt[item] if item in exempt else "met" if ok else f"not met ({had})"
                    for item, (ok, had) in met.items()}
        unmet = [f"{WORKLOAD_ITEMS[item]} ({met[item][1]})" for item, state in coverage.items()
                 if state.startswith("not met")]
        details = dict(requests=len(lengths), prompt_tokens=sum(lengths), mixed_steps=mixed, chunked_prefill=chunked,
                       loads=served.loads, evictions=served.evictions, reloads=served.reloads,
                       reloaded_requests=served.reloaded_requests, steps_guarded=len(work) - unguarded,
                       coverage=coverage, items=WORKLOAD_ITEMS, **graphs, **kinds)
        if unmet:
            r.partial(f"{len(unmet)} of {len(coverage)} coverage items not met: " + "; ".join(unmet), coverage,
                      **details)
        else:
            r.coverage = coverage
            r.passed(**details)
    return r


def not_meaningful(records: list[E2EResult], used: set[str | None], noop: dict[str, str]) -> None:
    """Mark the passed claims of ``records`` that relied on adapter deltas (E01, E02, E06) ``not_meaningful``
    when every adapter of ``used`` is a no-op (``noop``: adapter → why); failures stay failures."""
    adapters = sorted(a for a in used if a is not None)
    if not adapters or any(a not in noop for a in adapters):
        return
    why = "; ".join(f"{a}: {noop[a]}" for a in adapters)
    for rec in records:
        if rec.property in ("E01", "E02", "E06") and rec.outcome == "passed":
            rec.not_meaningful(f"every adapter it used is a no-op ({why}): it held for the base model only")


def _like(base: E2EResult, prop: str) -> E2EResult:
    return E2EResult(prop, base.backend, base.mode, base.dtype, base.model, repro=base.repro)
