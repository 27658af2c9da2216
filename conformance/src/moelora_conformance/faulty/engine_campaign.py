"""The engine mutants' campaign (``moelora-conformance mutations --engine``): each engine-level faulty
variant (:mod:`.engine_mutants`) against the E06 state machine's random search (the CI-sized run:
reference backend, one fixture family, 5 adapters on 3 slots, 20 examples, modes drawn, a fixed seed)
and against the named history of its fault class.

A mutant is *caught* when the machine's record fails; the seconds are the machine's wall time until
then (shrinking included, bounded by ``shrink_seconds``).
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
