"""What a failing property prints, and that its replay lines reproduce exactly what they name.

Covers: an item with two distinct failures (a delta failure on odd examples, a base-row failure on
even ones: each kind of check is its own exception type, so Hypothesis keeps them apart) reports
both, each with its own replay line, and each replay reproduces its own failure and only it; the
failure text puts the checks and the repro first and leaves Hypothesis' full report to the log; once
the fault is fixed, a replay says "did not reproduce: the failure is gone" and exits 0 (Hypothesis'
``DidNotReproduce`` is not a failure of the fixed backend).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moelora_conformance.session import run_suite

HERE = Path(__file__).resolve().parent
STAND_IN = HERE / "suite_data" / "test_p01_two_failures.py"


@pytest.mark.slow
def test_two_distinct_failures_get_two_replays_that_each_reproduce_only_their_own(tmp_path):
    env = {"MOELORA_TWO_FAILURES": "1"}
    run = run_suite("reference", profile="interpret", env=env, max_examples=30, report_json=tmp_path / "r.json",
                    extra=[str(STAND_IN), "-k", "eager-fp32"])
    assert run.returncode == 1, run.output[-3000:]
    (rec,) = run.report["records"]
    repro = rec["repro"]
    assert len(repro["replays"]) == 2 and all(repro["replays"]), repro
    kinds = sorted(m.split(":")[0] for m in repro["messages"])
    assert kinds == ["BaseRowMismatch", "DeltaMismatch"], repro["messages"]
    assert "2 distinct failures" in run.output and "replay failure 2" in run.output
    text = run.output
    assert text.index("moelora repro for") < text.index("Hypothesis: 2 distinct failures")
    hypothesis_report = "by temporarily adding @reproduce_failure"  # a line of Hypothesis' own report
    assert hypothesis_report not in text and hypothesis_report in Path(run.report["log"]).read_text()
    for message, replay in zip(repro["messages"], repro["replays"]):
        kind = message.split(":")[0]
        other = {"BaseRowMismatch": "DeltaMismatch", "DeltaMismatch": "BaseRowMismatch"}[kind]
        argv = shlex.split(replay)
        argv.insert(argv.index("-k"), str(STAND_IN))
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, **env, "TRITON_INTERPRET": "1"})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and kind in out and other not in out, out[-3000:]
    fixed = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, **env, "TRITON_INTERPRET": "1", "MOELORA_TWO_FAILURES_FIXED": "1"})
    out = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0, out[-3000:]
    assert "did not reproduce: the failure is gone" in out and "DidNotReproduce" not in out, out[-3000:]
