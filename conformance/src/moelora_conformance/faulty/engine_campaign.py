"""The engine mutants' campaign (``moelora-conformance mutations --engine``): each engine-level faulty
variant (:mod:`.engine_mutants`) against the E06 state machine's random search (the CI-sized run:
reference backend, one fixture family, 5 adapters on 3 slots, 20 examples, modes drawn, a fixed seed)
and against the named history of its fault class; and each backend fault only an engine shows
(:mod:`.e2e_mutants`) against the e2e workload (E01-E05) in every engine mode.

An engine mutant is *caught* when the machine's record fails; the seconds are the machine's wall time
until then (shrinking included, bounded by ``shrink_seconds``). A backend mutant of :mod:`.e2e_mutants`
is caught by the first failed claim of the e2e run; the seconds are the run's wall time until that
record (the eager reference run included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from moelora_conformance.fixtures.manifest import FixtureSet

#: The fixture family and adapters of the campaign, in the named histories' order (0: MoE + attention,
#: 3: fewer modules than 0, 4: registered later).
MODEL = "qwen3_moe"
ADAPTERS = ("qwen3_moe-r8", "qwen3_moe-rslora", "qwen3_moe-legacy", "qwen3_moe-down-only", "qwen3_moe-gate-up-only")


@dataclass(frozen=True)
class EngineMutationResult:
    """One engine mutant: whether the random machine caught it (its first failure line and seconds) and
    whether its fault class's history did."""

    name: str
    caught: bool
    message: str
    seconds: float
    history: str
    history_caught: bool
    history_message: str


def campaign_adapters(fixtures: FixtureSet) -> dict[str, Path]:
    return {name: fixtures.adapter_dir(name) for name in ADAPTERS}


def run_engine_mutation(name: str, fixtures: FixtureSet, *, max_examples: int = 20, seed: int = 0,
                        backend: str = "reference") -> EngineMutationResult:
    from moelora_conformance.e2e.stateful import run_state_machine
    from moelora_conformance.e2e.stateful_histories import run_history
    from moelora_conformance.faulty.engine_mutants import CAUGHT_BY_HISTORY, ENGINE_MUTANTS

    cls, history = ENGINE_MUTANTS[name], CAUGHT_BY_HISTORY[name]
    adapters = campaign_adapters(fixtures)
    model_dir = fixtures.model_dir(MODEL)
    start = time.perf_counter()
    (record,) = run_state_machine(backend=backend, model_dir=model_dir, adapters=adapters, max_examples=max_examples,
                                  max_loras=3, engine_class=cls, seed=seed)
    seconds = time.perf_counter() - start
    try:
        run_history(history, backend=backend, model_dir=model_dir, adapters=adapters, engine_class=cls)
        history_caught, history_message = False, ""
    except AssertionError as exc:
        history_caught, history_message = True, str(exc).splitlines()[0]
    return EngineMutationResult(name, record.outcome == "failed", record.message, seconds, history, history_caught,
                                history_message)


def run_engine_campaign(fixtures: FixtureSet, names: list[str] | None = None, *, progress=None,
                        **kwargs) -> list[EngineMutationResult]:
    """Every engine mutant of ``names`` (default: all); ``progress(result)`` after each."""
    from moelora_conformance.faulty.engine_mutants import ENGINE_MUTANTS

    results = []
    for name in names or list(ENGINE_MUTANTS):
        results.append(run_engine_mutation(name, fixtures, **kwargs))
        if progress is not None:
            progress(results[-1])
    return results


@dataclass(frozen=True)
class E2EMutationResult:
    """One backend mutant of :mod:`.e2e_mutants` on the e2e workload: the first failed claim (property,
    mode, the first line of its message) and the seconds until it was recorded."""

    name: str
    caught: bool
    property: str
    mode: str
    message: str
    seconds: float


#: The e2e workload of the backend mutants: the e2e tests' smaller one (16 requests, prompts up to 134
#: tokens — the chunk scene's three chunks —, arriving over 8 steps, 4 prefill-graph request slots), every
#: engine mode, no state machine; HF + PEFT only for :data:`E2E_NEEDS_HF`.
E2E_WORKLOAD = dict(requests=16, max_new_tokens=4, max_prompt_tokens=134, arrival_steps=8, max_num_requests=4,
                    state_machine_examples=0)


#: The e2e campaign's adapters: the engine campaign's and the layer-patterned fixture adapter (rank and α
#: patterns with layer-specific keys).
E2E_ADAPTERS = (*ADAPTERS, "qwen3_moe-pattern")
#: The backend mutants whose fault is the same eagerly and on the graphs: only HF + PEFT (E02) sees them.
E2E_NEEDS_HF = frozenset({"layer-zero-sigma", "same-config-reload-kept"})


#: The campaign's mode order: eager (every mode's reference), then the prefill graph modes, where most
#: faults of a graph family show, then the decode graph alone.
CAMPAIGN_MODES = ("eager", "full", "breakable", "decode_graph")


def run_e2e_mutation(name: str, fixtures: FixtureSet, *, seed: int = 0,
                     modes: tuple[str, ...] = CAMPAIGN_MODES) -> E2EMutationResult:
    """The e2e suite (:func:`moelora_conformance.e2e.run.run_model`) on backend mutant ``name`` over
    the campaign's model and adapters; caught by its first failed record."""
    from moelora_conformance.e2e.run import E2EConfig, run_model
    from moelora_conformance.faulty import target

    first: list[tuple[object, float]] = []
    start = time.perf_counter()

    def progress(record) -> None:
        if record.outcome == "failed" and not first:
            # the catch's time, without the diagnosis that followed it (``details["locate_seconds"]``)
            first.append((record, time.perf_counter() - start - record.details.get("locate_seconds", 0.0)))

    adapters = {n: fixtures.adapter_dir(n) for n in E2E_ADAPTERS}
    records = run_model(target(name), fixtures.model_dir(MODEL), adapters,
                        config=E2EConfig(seed=seed, modes=modes, **E2E_WORKLOAD), model_name=MODEL,
                        hf=name in E2E_NEEDS_HF, progress=progress)
    if not first:
        return E2EMutationResult(name, False, "", "", "", time.perf_counter() - start)
    record, seconds = first[0]
    assert record in records
    return E2EMutationResult(name, True, record.property, record.mode, record.message.splitlines()[0], seconds)


def run_e2e_campaign(fixtures: FixtureSet, names: list[str] | None = None, *, progress=None,
                     **kwargs) -> list[E2EMutationResult]:
    """Every backend mutant of :mod:`.e2e_mutants` in ``names`` (default: all); ``progress(result)``
    after each."""
    from moelora_conformance.faulty.e2e_mutants import E2E_MUTANTS

    results = []
    for name in names or list(E2E_MUTANTS):
        results.append(run_e2e_mutation(name, fixtures, **kwargs))
        if progress is not None:
            progress(results[-1])
    return results
