"""The e2e suite on the engine (``moelora_conformance.e2e``), CI-sized (DESIGN.md §9).

- ``test_reference_ci_sized_workload_holds_every_claim``: the CI-sized workload (64 ragged requests,
  1 to 248 prompt tokens, 8 new tokens, five adapters of five ranks and formats over 4 slots, base
  requests, spread arrivals and a burst) on ``reference`` in every engine mode: E01-E05 pass, and
  the run exercised what it claims (steps that fit and steps beyond capacity, both reasons).
- ``test_kernel_backend_small_workload``: ``triton`` / ``csgmv`` (Triton kernels under the
  interpreter) on a smaller workload (16 requests, prompts up to 40 tokens, arriving over 6 steps)
  eagerly and in one graph mode each (the other modes in ``nox -s e2e`` and on the GPU): E01-E05 pass.
- ``test_faults_are_caught``: faulty backends (``e2e_faults``) fail exactly the claims they break:
  a wrong graph-mode delta fails E01 and E02 in the graph modes and passes eagerly; a backend that
  silently falls back fails E03 naming the step and the reason; a backend whose buckets share one
  buffer set and keep a larger batch's request tail (``faulty.e2e_mutants``, the suite's own mutant)
  fails E01 in the prefill graph.
- ``test_capacity_labels``: the capacity a step is held to, on hand-made steps (both limits, both
  phases, every mode).
"""

from __future__ import annotations

import pytest

from moelora_conformance.e2e.checks import Capacity
from moelora_conformance.e2e.run import E2EConfig, run_model
from moelora_conformance.e2e.workload import StepRecord
from moelora_conformance.faulty import target

MODEL = "qwen3_moe"
#: The smaller workload of the kernel backends and the fault tests.
SMALL = dict(requests=16, max_new_tokens=4, max_prompt_tokens=40, arrival_steps=6, state_machine_examples=0)


def _run(fixture_set, engine_adapters, backend, model=MODEL, hf=True, **config):
    return run_model(backend, fixture_set.model_dir(model), engine_adapters[model], config=E2EConfig(**config),
                     model_name=model, hf=hf)


def _by(records):
    return {(r.property, r.mode): r for r in records}


def _assert_all_passed(records):
    bad = [f"{r.test}: {r.outcome} {r.message}" for r in records if r.outcome != "passed"]
    assert not bad, "\n".join(bad)


@pytest.mark.xdist_group("e2e-reference")
def test_reference_ci_sized_workload_holds_every_claim(fixture_set, engine_adapters):
    records = _run(fixture_set, engine_adapters, "reference", state_machine_examples=0)
    _assert_all_passed(records)
    by = _by(records)
    assert {p for p, _ in by} == {"E01", "E02", "E03", "E04", "E05"}
    assert len(records) == 2 + 5 * 3  # eager: E02, E05; each graph mode: E01-E05
    e05 = by[("E05", "eager")].details
    assert e05["requests"] == 64 and e05["mixed_steps"] > 0 and e05["evictions"] > 0 and e05["chunked_prefill"]
    assert len(e05["ranks"]) >= 3 and e05["rslora"] and e05["per_expert"]
    passes = by[("E03", "full")].details["passes"]
    for label in ("prefill/full/", "decode/decode_graph/", "prefill/eager/over_tokens",
                  "prefill/eager/over_requests", "decode/eager/over_requests"):
        assert passes.get(label, 0) > 0, (label, passes)
    assert by[("E02", "eager")].details["compared"] > 0


@pytest.mark.interpreter
@pytest.mark.parametrize(("backend", "mode"), [
    pytest.param("triton", "full", marks=pytest.mark.xdist_group("e2e-triton")),
    pytest.param("csgmv", "breakable", marks=pytest.mark.xdist_group("e2e-csgmv")),
])
def test_kernel_backend_small_workload(backend, mode, fixture_set, engine_adapters):
    records = _run(fixture_set, engine_adapters, backend, modes=("eager", mode), **SMALL)
    # E04 may find no step beyond capacity in a small workload: not_run there, never passed
    _assert_all_passed([r for r in records if not (r.property == "E04" and r.outcome == "not_run")])
    assert {r.mode for r in records} == {"eager", mode}


@pytest.mark.xdist_group("e2e-reference")
def test_faults_are_caught(fixture_set, engine_adapters):
    wrong = _by(_run(fixture_set, engine_adapters, "e2e_faults:make_graph_delta_backend", modes=("eager", "full"),
                     **SMALL))
    assert wrong[("E01", "full")].outcome == "failed" and "full vs eager" in wrong[("E01", "full")].message
    assert wrong[("E02", "full")].outcome == "failed"
    assert wrong[("E02", "eager")].outcome == "passed" and wrong[("E05", "eager")].outcome == "passed"
    refusing = _by(_run(fixture_set, engine_adapters, "e2e_faults:make_refusing_backend", modes=("eager", "breakable"),
                        hf=False, **SMALL))
    e03 = refusing[("E03", "breakable")]
    assert e03.outcome == "failed" and "backend_fallback" in e03.message and "did not run on their graph" in e03.message
    assert refusing[("E01", "breakable")].outcome == "passed"  # eager fallbacks are right: only E03 sees it
    stale = _by(_run(fixture_set, engine_adapters, target("stale-tail-across-buckets"), modes=("eager", "full"),
                     hf=False, **SMALL))
    assert stale[("E01", "full")].outcome == "failed" and "full vs eager" in stale[("E01", "full")].message
    assert stale[("E03", "full")].outcome == "passed"  # it ran on its graphs: only the outputs show the tail


def test_capacity_labels():
    cap = Capacity(prefill_tokens=48, prefill_requests=8, decode_requests=8)

    def step(phase, requests, tokens):
        return StepRecord(phase, requests, tokens, 0, 0, ("", ""))

    assert cap.expected(step("prefill", 3, 48), "full") == {("full", "")}
    assert cap.expected(step("prefill", 3, 49), "breakable") == {("eager", "over_tokens")}
    assert cap.expected(step("prefill", 9, 40), "full") == {("eager", "over_requests")}
    assert cap.expected(step("prefill", 9, 60), "full") == {("eager", "over_requests"), ("eager", "over_tokens")}
    assert cap.expected(step("prefill", 9, 60), "decode_graph") == {("eager", "disabled")}
    assert cap.expected(step("decode", 8, 8), "full") == {("decode_graph", "")}
    assert cap.expected(step("decode", 9, 9), "decode_graph") == {("eager", "over_requests")}
    assert cap.expected(step("decode", 9, 9), "eager") == {("eager", "disabled")}
    # a small bucket has one request slot per token at most
    assert Capacity(4, 8, 8).expected(step("prefill", 5, 4), "full") == {("eager", "over_requests")}
