"""Honest results: nothing that did not run is reported as passed, and a run that tested nothing fails.

Covers: the fixed outcome words of a record (a collected item is ``not_run`` until its call passed;
strict XPASS, setup errors, skips for another reason than a capability); an item cut off by an
interrupt (a time budget's SIGINT) and every item after it are ``not_run`` in the JSON report, and
the matrix shows "not run" for them and "–" only where a property has no such mode; after a ``-x``
stop, the items of a mode the backend does not declare are ``not_implemented`` (known at collection),
not ``not_run``; a worker that
dies under xdist leaves its item ``failed``; split runs of one backend merge into one matrix row; a
run in which every item is "not implemented" exits 5 and names the cause (a device the backend does
not declare; a Triton backend on a CPU without ``TRITON_INTERPRET=1``); the report header records
``TRITON_INTERPRET`` and where the backend was imported from.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from moelora_conformance.properties.registry import PROPERTIES
from moelora_conformance.report import cell, matrix_markdown, merge_reports, new_record, record_phase
from moelora_conformance.session import run_suite
from moelora_core import Capabilities
from moelora_reference.backend import ReferenceBackend

HERE = Path(__file__).resolve().parent
FIELDS = {"property": "P01", "title": "t", "mode": "eager", "dtype": "fp32", "test": "test_x[eager-fp32]"}


def _fold(phases, **start):
    records = {"n": new_record("n", FIELDS)} if start.get("collected", True) else {}
    for when, kw in phases:
        args = dict(passed=False, failed=False, skipped=False, duration=0.01, wasxfail=None, skip_reason="",
                    last_line="")
        args.update(kw)
        rec = record_phase(records, nodeid="n", info=FIELDS, when=when, **args)
    return rec if phases else records["n"]


def test_record_outcomes_are_the_fixed_words():
    assert _fold([])["outcome"] == "not_run"  # collected, never started
    assert _fold([("setup", {"passed": True})])["outcome"] == "not_run"  # started, cut off in the call
    assert _fold([("setup", {"passed": True}), ("call", {"passed": True}),
                  ("teardown", {"passed": True})])["outcome"] == "passed"
    assert _fold([("setup", {"failed": True, "last_line": "E boom"})])["outcome"] == "failed"
    assert _fold([("setup", {"passed": True}), ("call", {"failed": True}),
                  ("teardown", {"passed": True})])["outcome"] == "failed"
    assert _fold([("setup", {"passed": True}), ("call", {"passed": True}),
                  ("teardown", {"failed": True})])["outcome"] == "failed"
    assert _fold([("setup", {"skipped": True, "skip_reason": "not implemented: dtype fp16"})])["outcome"] \
        == "not_implemented"
    assert _fold([("setup", {"skipped": True, "skip_reason": "not run: peft is not installed"})])["outcome"] \
        == "not_run"
    assert _fold([("setup", {"passed": True}), ("call", {"skipped": True, "wasxfail": "manifest: x"})])["outcome"] \
        == "xfailed"
    assert _fold([("setup", {"passed": True}), ("call", {"failed": True, "last_line": "[XPASS(strict)] manifest: x"})
                  ])["outcome"] == "xpassed"
    crashed = _fold([("???", {"failed": True, "last_line": "worker 'gw0' crashed while running 'n'"})],
                    collected=False)
    assert crashed["outcome"] == "failed" and "crashed" in crashed["message"]


def test_matrix_tells_not_run_from_not_applicable_and_merges_split_runs():
    def rep(records):
        return {"backend": {"name": "b", "version": "1", "target": "b"}, "profile": "interpret", "device": "cpu",
                "duration": 1.0, "records": records, "manifest_unmatched": []}

    def r(pid, mode, outcome, dtype="fp32"):
        return {**FIELDS, "property": pid, "mode": mode, "dtype": dtype, "outcome": outcome,
                "nodeid": f"test_p{pid[1:]}_x.py::t[{mode}-{dtype}]", "test": f"t[{mode}-{dtype}]"}

    assert cell([], is_applicable=True) == "not run" and cell([], is_applicable=False) == "–"
    first = rep([r("P05", "decode", "passed"), r("P05", "prefill-full", "not_run")])
    second = rep([r("P05", "prefill-full", "passed"), r("P01", "eager", "failed")])
    (merged,) = merge_reports([first, second])
    outcomes = {(x["property"], x["mode"]): x["outcome"] for x in merged["records"]}
    assert outcomes == {("P05", "decode"): "passed", ("P05", "prefill-full"): "passed", ("P01", "eager"): "failed"}
    text = matrix_markdown([first, second])
    rows = [line for line in text.splitlines() if line.startswith("| P0")]
    assert len(rows) == 2, rows  # one row per property: the two runs of backend b are merged
    p05 = next(line for line in rows if line.startswith("| P05"))
    # P05 has no eager mode ("–"); its prefill-breakable items ran in neither run ("not run")
    assert "| – | pass | pass | not run |" in p05, p05
    assert "2 runs merged" in text


def _env(**kw):
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **kw}


@pytest.mark.slow
def test_an_item_cut_off_is_not_run_never_passed():
    run = run_suite("reference", profile="interpret", max_examples=2, extra=["-p", "interrupting"],
                    env=_env(MOELORA_TEST_CUT="test_metadata_is_exact[decode-fp32]"))
    assert run.returncode == 2, run.output[-3000:]  # pytest's "interrupted"
    records = {r["test"]: r for r in run.report["records"]}
    assert len(records) == sum(len(p.modes) for p in PROPERTIES.values()) * 2, len(records)  # every item
    cut = records["test_metadata_is_exact[decode-fp32]"]
    assert cut["outcome"] == "not_run" and cut["phase"] != "call", cut
    assert records["test_every_output_row_equals_the_oracle[eager-fp32]"]["outcome"] == "not_run"
    assert {r["outcome"] for r in records.values()} <= {"passed", "not_run"}
    assert all(r["outcome"] == "not_run" for r in records.values() if r["duration"] < 1e-3)
    assert "not run" in matrix_markdown([run.report])
    assert "did not finish (not_run)" in run.output


@pytest.mark.slow
def test_a_crashed_worker_leaves_its_item_failed():
    run = run_suite("reference", profile="interpret", max_examples=2, workers=1, extra=["-p", "interrupting",
                    "-k", "test_metadata_is_exact and eager"],
                    env=_env(MOELORA_TEST_CUT="test_metadata_is_exact[eager-fp16]", MOELORA_TEST_CUT_HOW="crash"))
    assert run.returncode == 1, run.output[-3000:]
    records = {r["test"]: r for r in run.report["records"]}
    crashed = records["test_metadata_is_exact[eager-fp16]"]
    assert crashed["outcome"] == "failed" and "crashed" in crashed["message"], crashed
    assert records["test_metadata_is_exact[eager-fp32]"]["outcome"] == "passed"


class NoBreakable(ReferenceBackend):
    """The reference without the prefill ``breakable`` graph mode."""

    name = "no-breakable"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), prefill_graph_modes=frozenset({"full"}))


def make_no_breakable(spec):
    return NoBreakable(spec)


@pytest.mark.slow
def test_undeclared_modes_stay_not_implemented_after_a_stop():
    run = run_suite("test_plugin_outcomes:make_no_breakable", profile="interpret", max_examples=2,
                    extra=["-p", "interrupting", "-x"],
                    env=_env(MOELORA_TEST_CUT="test_metadata_is_exact[eager-fp32]", MOELORA_TEST_CUT_HOW="fail"))
    assert run.returncode == 1, run.output[-3000:]
    records = run.report["records"]
    breakable = [r for r in records if r["mode"] == "prefill-breakable"]
    assert breakable and all(r["outcome"] == "not_implemented" for r in breakable), breakable[:2]
    assert all(r["reason"] == "not implemented: prefill graph mode breakable" for r in breakable)
    others = [r for r in records if r["mode"] != "prefill-breakable" and r["outcome"] != "failed"]
    assert others and {r["outcome"] for r in others} <= {"not_run", "passed"} and any(r["outcome"] == "not_run" for r in others)
    lines = matrix_markdown([run.report]).splitlines()
    head = [c.strip() for c in next(line for line in lines if line.startswith("| property")).split("|")]
    row = [c.strip() for c in next(line for line in lines if line.startswith("| P01 ")).split("|")]
    assert row[head.index("prefill-breakable")] == "n/i" and row[head.index("decode")] == "not run", row


class CudaOnly(ReferenceBackend):
    """The reference declaring CUDA only (as a GPU backend does)."""

    name = "cuda-only"

    def capabilities(self):
        return Capabilities(dtypes=frozenset({torch.float32, torch.float16}), devices=frozenset({"cuda"}))


def make_cuda_only(spec):
    return CudaOnly(spec)


@pytest.mark.slow
def test_a_run_where_everything_is_not_implemented_exits_5_and_names_the_device():
    run = run_suite("test_plugin_outcomes:make_cuda_only", profile="interpret", env=_env())
    assert run.returncode == 5, run.output[-3000:]
    assert {r["outcome"] for r in run.report["records"]} == {"not_implemented"}
    assert "this run tested nothing" in run.output and "declares devices ['cuda']" in run.output
    assert run.report["diagnosis"] and "cuda" in run.report["diagnosis"]


@pytest.mark.slow
def test_a_triton_backend_on_a_cpu_without_the_interpreter_exits_5_and_says_so():
    pytest.importorskip("moelora_backends")
    run = run_suite("triton", profile="interpret", env={"TRITON_INTERPRET": "0"}, extra=["-k", "test_metadata_is_exact"])
    assert run.returncode == 5, run.output[-3000:]
    assert "TRITON_INTERPRET=1" in run.output and "Triton interpreter" in run.output
    assert run.report["environment"]["TRITON_INTERPRET"] == "0"
    assert run.report["backend"]["module"] == "moelora_backends.triton_backend"
    assert run.report["backend"]["file"].endswith("triton_backend.py")
