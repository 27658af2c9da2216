"""The support matrix and its commands: cells, Markdown, rich output, repro lines.

Covers: a cell is "pass" only when every dtype passed and otherwise names each dtype's outcome,
"n/i" (not implemented) and "xfail" are told apart from failures, modes a property does not have are
"–" and modes it has without a record "not run"; the
Markdown matrix has a row per property × backend and a column per mode and lists unexpected
failures with their repro commands and unmatched manifest entries; a property other than P01 that
fails the standard checks of its own batches is marked "FAIL (oracle)"; ``load_report`` refuses other
JSON; ``moelora-conformance report`` renders files and exits as the run did (1 for an unexpected
failure or a stale manifest entry, 0 when every failure is expected, 5 when nothing ran; ``partial``
and ``not meaningful`` listed under "Not proven", each coverage item met / not met, and exit 1 only with
``--require-coverage``; every ``not run`` with its reason); ``moelora-conformance run`` runs the suite in
a subprocess and prints the matrix with rich; repro blobs are found in Hypothesis' notes and the
commands quote their arguments, the rerun line keeping ``--no-shrink``.
"""

import json
import shlex

import pytest

from moelora_conformance.cli import main
from moelora_conformance.report import cell, load_report, matrix_markdown, matrix_rich, summarize
from moelora_conformance.repro import build_repro, extract_blob


def rec(prop, mode, dtype, outcome, **kw):
    return {"property": prop, "mode": mode, "dtype": dtype, "outcome": outcome, "test": f"t[{mode}-{dtype}]",
            "duration": 0.1, **kw}


def report(name, records, **kw):
    return {"backend": {"name": name, "version": "1", "target": name}, "profile": "interpret", "device": "cpu",
            "duration": 3.0, "records": records, "manifest_unmatched": [], **kw}


def test_cells():
    assert cell([rec("P01", "eager", "fp32", "passed"), rec("P01", "eager", "fp16", "passed")]) == "pass"
    assert cell([rec("P01", "eager", "fp32", "passed"), rec("P01", "eager", "fp16", "failed")]) == "fp16 FAIL · fp32 pass"
    assert cell([rec("P10", "eager", "fp32", "not_implemented")]) == "n/i"
    assert cell([rec("P05", "decode", "fp32", "xfailed")]) == "xfail"
    assert cell([]) == "not run" and cell([], is_applicable=False) == "–"
    # a property other than P01 failing the standard checks of its own batches is told apart from
    # a failure of its own claim (a new user read P08 FAIL as a host sync that was not there)
    assert cell([rec("P08", "eager", "fp32", "failed", check="oracle")]) == "FAIL (oracle)"
    assert cell([rec("P08", "eager", "fp32", "failed", check="oracle"),
                 rec("P08", "eager", "fp16", "passed")]) == "fp32 FAIL (oracle) · fp16 pass"
    assert cell([rec("P08", "eager", "fp32", "failed")]) == "FAIL"
    assert cell([rec("P01", "eager", "fp32", "failed", check="oracle")]) == "FAIL"


@pytest.mark.slow
def test_a_wrong_delta_found_by_p08_is_marked_as_an_oracle_failure():
    from moelora_conformance.faulty import target
    from moelora_conformance.session import run_suite

    run = run_suite(target("up-uses-gate-A"), profile="interpret", max_examples=3, no_shrink=True,
                    hypothesis_seed=0, extra=["-k", "test_no_host_sync_in_prepare_and_forward and eager-fp32"])
    (record,) = run.report["records"]
    assert record["outcome"] == "failed" and record.get("check") == "oracle", run.output[-3000:]
    assert cell([record]) == "FAIL (oracle)"


def test_markdown_matrix_of_two_backends():
    repro = {"replay": "pytest -k 'x' --moelora-replay v:b", "rerun": ""}
    a = report("ref", [rec("P01", "eager", "fp32", "passed"), rec("P06", "decode", "fp32", "passed")])
    b = report("other", [rec("P01", "eager", "fp32", "failed", message="AssertionError: off", repro=repro),
                         rec("P06", "decode", "fp32", "not_implemented")],
               manifest_unmatched=["expected_failure[0] (property=P09 mode=* dtype=*)"])
    text = matrix_markdown([a, b])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| property"))
    # every mode of the properties present; one that never ran is "not run", one a property lacks "–"
    assert header == "| property | backend | eager | decode | prefill-full | prefill-breakable | prefill |"
    assert any(line.startswith("| P01 ") and "| ref | pass | not run | not run | not run | – |" in line for line in lines)
    assert any(line.startswith("| P01 ") and "| other | FAIL | not run |" in line for line in lines)
    assert any(line.startswith("| P06 ") and "| other | – | n/i | – | – | not run |" in line for line in lines)
    assert "--moelora-replay v:b" in text and "matched nothing" in text
    assert summarize(b["records"]) == {"failed": 1, "not_implemented": 1}


def test_rich_matrix_prints(capsys):
    from rich.console import Console

    matrix_rich([report("ref", [rec("P01", "eager", "fp32", "passed")])], console=Console(width=160))
    out = capsys.readouterr().out
    assert "support matrix" in out and "P01" in out and "pass" in out


def test_load_report_refuses_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"tests": []}))
    with pytest.raises(ValueError, match="not a moelora conformance report"):
        load_report(p)


def test_report_command_renders_files(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(report("ref", [rec("P01", "eager", "fp32", "passed")])))
    assert main(["report", str(p)]) == 0
    assert "| P01 " in capsys.readouterr().out
    out = tmp_path / "m.md"
    assert main(["report", str(p), "--output", str(out)]) == 0
    assert "support matrix" in out.read_text()
    assert main(["report", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize(("outcomes", "status", "covered"), [
    (["passed", "xfailed"], 0, 0),                # every failure in the manifest
    (["passed", "failed"], 1, 1),                 # an unexpected failure
    (["passed", "xpassed"], 1, 1),                # a stale manifest entry
    (["passed", "partial"], 0, 1),                # not proven: a failure only with --require-coverage
    (["not_meaningful", "not_run"], 0, 1),
    (["not_run", "not_implemented"], 5, 5),       # nothing ran
])
def test_report_exits_as_the_run_did(tmp_path, capsys, outcomes, status, covered):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(report("ref", [rec(f"P0{i + 1}", "eager", "fp32", o, reason=f"why {o}")
                                           for i, o in enumerate(outcomes)])))
    assert main(["report", str(p)]) == status
    assert main(["report", str(p), "--require-coverage"]) == covered
    capsys.readouterr()


def test_not_proven_and_not_run_are_listed_with_their_items_and_reasons():
    e05 = rec("E05", "eager", "fp32", "partial", model="m", reason="2 of 3 coverage items not met",
              coverage={"requests": "not met (16 requests)", "base": "met", "per_expert": "not applicable on gpt_oss"},
              details={"items": {"requests": "64 ragged requests", "base": "base requests",
                                 "per_expert": "a legacy per-expert adapter"}})
    text = matrix_markdown([report("ref", [
        e05, {**e05, "mode": "full"},
        rec("E02", "eager", "fp32", "not_meaningful", model="m", reason="every adapter it used is a no-op (a: x)"),
        rec("E04", "full", "fp32", "not_run", reason="no step of this run was beyond the captured capacity"),
        rec("P01", "decode", "fp32", "not_run", reason=""),
    ])])
    assert "; not proven: 3 (E05 partial × 2, E02 not meaningful × 1)" in text
    proven = text.split("## Not proven")[1].split("## Not run")[0]
    assert "- E05 [eager, full; fp32; m] partial: not met: 64 ragged requests (16 requests) · met: base requests · " \
           "not applicable: a legacy per-expert adapter (not applicable on gpt_oss)" in proven
    assert "- E02 [eager; fp32; m] not meaningful: every adapter it used is a no-op (a: x)" in proven
    cut = text.split("## Not run")[1]
    assert "- E04 [full] not run: no step of this run was beyond the captured capacity" in cut
    assert "- P01 [decode] not run: did not finish (cut off" in cut


@pytest.mark.slow
def test_run_command_runs_the_suite_and_prints_the_matrix(tmp_path, capsys):
    status = main(["run", "--backend", "reference", "--profile", "interpret", "--max-examples", "2",
                   "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "m.md"),
                   "--", "-k", "test_metadata_is_exact"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "support matrix" in out
    data = load_report(tmp_path / "r.json")
    assert {r["property"] for r in data["records"]} == {"P07"}
    assert "| P07 " in (tmp_path / "m.md").read_text()


def test_extract_blob_from_hypothesis_notes():
    exc = AssertionError("boom")
    exc.add_note("You can reproduce this example by temporarily adding @reproduce_failure('6.1.2', b'AXic==') "
                 "as a decorator on your test case")
    assert extract_blob(exc) == ("6.1.2", "AXic==")
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = exc
    assert extract_blob(wrapped) == ("6.1.2", "AXic==")
    assert extract_blob(ValueError("no blob")) is None


def test_repro_commands_quote_their_arguments():
    r = build_repro(test="test_x[decode-fp16]", backend="my.mod:make", device="cpu", profile="gpu", caps_profile="gpu",
                    hypothesis_seed=12, blob=("6.1", "AB+/=="), trace=["case: seed=3"])
    replay = shlex.split(r.replay)
    assert replay[replay.index("-k") + 1] == "test_x[decode-fp16]"
    assert replay[replay.index("--profile") + 1] == "repro" and replay[replay.index("--repro-caps") + 1] == "gpu"
    assert replay[replay.index("--moelora-replay") + 1] == "6.1:AB+/=="
    assert "--hypothesis-seed=12" in shlex.split(r.rerun) and "--repro-caps" not in r.rerun
    assert "case: seed=3" in r.text() and r.as_dict()["trace"] == ["case: seed=3"]


def test_repro_rerun_lines_for_derandomized_budgeted_and_replay_runs():
    common = dict(test="test_x[eager-fp32]", backend="reference", device="cpu", caps_profile="interpret",
                  blob=("6.1", "AB=="), trace=["case: seed=1"])
    derand = build_repro(profile="interpret", hypothesis_seed=None, derandomized=True, max_examples=2, **common)
    assert derand.rerun.startswith("CI=true pytest ")  # no seed: CI=true derandomizes the same search
    rerun = shlex.split(derand.rerun)[1:]
    assert rerun[rerun.index("--max-examples") + 1] == "2" and "--hypothesis-seed" not in derand.rerun
    seeded = build_repro(profile="interpret", hypothesis_seed=5, max_examples=3, **common)
    assert "--max-examples" in seeded.rerun and "--hypothesis-seed=5" in seeded.rerun
    assert build_repro(profile="interpret", hypothesis_seed=None, **common).rerun == ""
    assert build_repro(profile="repro", hypothesis_seed=5, derandomized=True, **common).rerun == ""
    assert "--no-shrink" in build_repro(profile="interpret", hypothesis_seed=5, no_shrink=True, **common).rerun


def test_per_backend_options():
    from moelora_conformance.commands import per_backend

    assert per_backend(["3", "triton=1"], "triton") == "1"  # a value named for the backend wins
    assert per_backend(["triton=1", "3"], "reference") == "3"  # a bare value applies to every backend
    assert per_backend(["csgmv=m.toml"], "reference") is None
    assert per_backend(None, "reference") is None


def test_dtype_and_mode_selection_picks_the_items_pytest_k_would():
    # the main job runs the kernel backends in fp32 with one prefill graph mode each (noxfile.py MAIN_RUN)
    from _pytest.mark.expression import Expression

    from moelora_conformance.cli import _selection

    flag, expr = _selection("fp32", "prefill-breakable")
    assert flag == "-k"
    names = ["test_every_output_row_equals_the_oracle[prefill-breakable-fp32]",
             "test_every_output_row_equals_the_oracle[prefill-full-fp32]",
             "test_metadata_is_exact[prefill-fp32]", "test_replay_equals_eager[decode-fp32]",
             "test_replay_equals_eager[prefill-full-fp16]"]
    kept = [n for n in names if Expression.compile(expr).evaluate(lambda word, n=n: word in n)]
    assert kept == names[1:4]
    (_, expr) = _selection(None, "eager")  # "eager" in a test's name is not the eager mode
    assert Expression.compile(expr).evaluate(lambda word: word in "test_replay_equals_eager[decode-fp32]")
    assert _selection(None, None) == []
    assert "unknown ['prefil']" in _selection(None, "prefil")
    assert "every mode" in _selection(None, "eager,decode,prefill-full,prefill-breakable")
    assert "unknown ['fp64']" in _selection("fp64", None)
