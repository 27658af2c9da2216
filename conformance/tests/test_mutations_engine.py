"""The engine-level faulty variants (``faulty/engine_mutants.py``) are caught by the stateful engine
properties (E06).

Covers: every engine mutant is registered with the named history of its fault class; each one fails
that history (an explicit sequence of the state machine's rules, with its invariants) on the fixtures'
``qwen3_moe`` adapters — the production engine passes every history
(``packages/runner/tests/test_engine_state_machine.py::test_named_history``); the docs table lists
each as caught. The random search's catch (20 examples, seed 0) is ``moelora-conformance mutations
--engine`` (seconds in ``docs/mutations.md``), not run here: it costs about 30 s per mutant on 2 cores.
"""

from pathlib import Path

import pytest

pytest.importorskip("moelora_runner")

from moelora_conformance.e2e.stateful_histories import HISTORIES, run_history
from moelora_conformance.faulty.engine_campaign import MODEL, campaign_adapters
from moelora_conformance.faulty.engine_mutants import CAUGHT_BY_HISTORY, ENGINE_MUTANTS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "mutations.md"


def test_every_engine_mutant_names_its_history():
    assert set(CAUGHT_BY_HISTORY) == set(ENGINE_MUTANTS)
    assert set(CAUGHT_BY_HISTORY.values()) <= set(HISTORIES)
    for cls in ENGINE_MUTANTS.values():
        assert cls.__doc__.strip() and "FAULT" not in cls.__doc__


@pytest.mark.parametrize("name", list(ENGINE_MUTANTS))
def test_engine_mutant_fails_the_history_of_its_fault(name, fixture_set):
    history = CAUGHT_BY_HISTORY[name]
    with pytest.raises(AssertionError) as caught:
        run_history(history, backend="reference", model_dir=fixture_set.model_dir(MODEL),
                    adapters=campaign_adapters(fixture_set), engine_class=ENGINE_MUTANTS[name])
    print(f"{name}: {history}: {str(caught.value).splitlines()[0]}")


def test_the_docs_table_lists_every_engine_mutant_as_caught():
    text = DOCS.read_text()
    for name in ENGINE_MUTANTS:
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"{name} missing from {DOCS.name}"
        assert "NOT CAUGHT" not in rows[0], rows[0]
