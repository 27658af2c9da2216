"""The engine-level faulty variants (``faulty/engine_mutants.py``) are caught by the stateful engine
properties (E06); the backend faults only an engine shows (``faulty/e2e_mutants.py``) hold their fault.

Covers: every engine mutant is registered with the named history of its fault class; each one fails
that history (an explicit sequence of the state machine's rules, with its invariants) on the fixtures'
``qwen3_moe`` adapters — the production engine passes every history
(``packages/runner/tests/test_engine_state_machine.py::test_named_history``); the docs table lists
each as caught. The random search's catch (20 examples, seed 0) is ``moelora-conformance mutations
--engine`` (seconds in ``docs/mutations.md``), not run here: it costs about 30 s per mutant on 2 cores.
``stale-tail-across-buckets`` keeps a larger bucket's requests in a smaller bucket's views where the
reference resets them (the e2e catch itself: ``e2e/test_e2e_workload.py::test_faults_are_caught``), and
the docs table lists it as caught.
"""

import re
from pathlib import Path

import pytest

pytest.importorskip("moelora_runner")

from moelora_conformance.e2e.stateful_histories import HISTORIES, run_history
from moelora_conformance.faulty import E2E_MUTANTS, FACTORIES
from moelora_conformance.faulty.engine_campaign import MODEL, campaign_adapters
from moelora_conformance.faulty.engine_mutants import CAUGHT_BY_HISTORY, ENGINE_MUTANTS
from moelora_core import BatchSpec, ForwardMode, GraphCapacity, LoRALayerSpec, Request
from moelora_reference.backend import ReferenceBackend

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


def test_stale_tail_across_buckets_keeps_a_larger_buckets_requests():
    spec = LoRALayerSpec(8, 8, 4, 2, {}, 3, 4)
    pool = (3, (4, 4, 4), (1.0, 1.0, 1.0))
    larger = BatchSpec(ForwardMode.EXTEND, [Request(s, 2) for s in (0, 1, 2, 0, 1, 2)], *pool)  # offsets 0, 2, .., 12
    small = BatchSpec(ForwardMode.EXTEND, [Request(1, 9)], *pool)
    infos = {}
    for cls in (ReferenceBackend, E2E_MUTANTS["stale-tail-across-buckets"]):
        backend = cls(spec)
        backend.init_graph("prefill", GraphCapacity.prefill(16, 6))
        backend.prepare(larger, "prefill")
        infos[cls] = backend.prepare(small, "prefill", GraphCapacity.prefill(12, 4))
    clean, mutant = infos.values()
    assert clean.req_seg_indptr.tolist() == [0, 9, 9, 9, 9]
    assert mutant.req_seg_indptr.tolist() == [0, 9, 4, 6, 8]  # the larger batch's offsets, left behind
    assert clean.token_lora_mapping.tolist() == [1] * 9 + [-1] * 3
    assert mutant.token_lora_mapping.tolist() != clean.token_lora_mapping.tolist()  # live rows get another slot
    assert "stale-tail-across-buckets" in FACTORIES


def test_the_docs_table_lists_every_e2e_mutant_as_caught():
    text = DOCS.read_text()
    for name, cls in E2E_MUTANTS.items():
        assert cls.__doc__.strip() and "FAULT" not in cls.__doc__
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1 and "NOT CAUGHT" not in rows[0] and re.search(r"E0[1-6]", rows[0]), rows


def _prefill_infos(batches, name):
    """The token maps the reference backend and mutant ``name`` give ``batches`` prepared in turn on one
    prefill family (capacity 16 tokens, 6 requests)."""
    spec = LoRALayerSpec(8, 8, 4, 2, {}, 3, 4)
    out = {}
    for cls in (ReferenceBackend, E2E_MUTANTS[name]):
        backend = cls(spec)
        backend.init_graph("prefill", GraphCapacity.prefill(16, 6))
        out[cls] = [backend.prepare(b, "prefill").token_lora_mapping.tolist() for b in batches]
    return out.values()


def test_chunk_metadata_memoised_keeps_the_previous_chunk_layout():
    pool = (3, (4, 4, 4), (1.0, 1.0, 1.0))
    middle = BatchSpec(ForwardMode.EXTEND, [Request(0, 1, 5), Request(1, 12, 12)], *pool)  # a decode, a chunk
    last = BatchSpec(ForwardMode.EXTEND, [Request(1, 8, 24), Request(0, 1, 6)], *pool)
    last_same_slots = BatchSpec(ForwardMode.EXTEND, [Request(0, 1, 6), Request(1, 8, 24)], *pool)
    clean, mutant = _prefill_infos([middle, last_same_slots], "chunk-metadata-memoised")
    assert clean[1] == [0] + [1] * 8 + [-1] * 7
    assert mutant[1] == clean[0] == [0] + [1] * 12 + [-1] * 3  # the middle chunk's layout, kept
    clean, mutant = _prefill_infos([middle, last], "chunk-metadata-memoised")
    assert mutant == clean  # other slots in the list: prepared anew


def test_hot_slot_frozen_at_capture_drops_a_slot_loaded_after_the_capture():
    capture = BatchSpec(ForwardMode.IDLE, [], 3, (4, 0, 0), (1.0, 0.0, 0.0))  # slot 1 empty at capture
    hot = BatchSpec(ForwardMode.EXTEND, [Request(0, 2), Request(1, 3)], 3, (4, 4, 0), (1.0, 1.0, 0.0))
    clean, mutant = _prefill_infos([capture, hot], "hot-slot-frozen-at-capture")
    assert clean[1][:5] == [0, 0, 1, 1, 1] and mutant[1][:5] == [0, 0, -1, -1, -1]
