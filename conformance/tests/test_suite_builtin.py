"""The conformance suite over moelora's built-in backends, in the ``interpret`` profile: the run of
the suite that ``nox -s tests`` (and so ``.ci/run``) makes.

Covers: the reference backend passes every property, in every mode and dtype, with every capability
declared and an empty manifest (nothing "not implemented", nothing skipped); the report holds one
record per property × mode × dtype; the ``triton`` and ``csgmv`` backends, once their package is
installed, pass everything they declare within a per-backend example budget (Triton kernels run
under the interpreter, far slower than the torch reference).
"""

import importlib
import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moelora_conformance.properties.registry import PROPERTIES
from moelora_conformance.report import unexpected_failures
from moelora_conformance.session import run_suite
from moelora_core.backend import BUILTIN_BACKENDS

#: Examples per property item on the CPU (None = the profile's). Override all with MOELORA_MAX_EXAMPLES.
#: triton / csgmv: 2 per item (Triton kernels under the interpreter, ~7 s an item on one CI core).
EXAMPLE_BUDGET = {"reference": None, "triton": 2, "csgmv": 2}
DTYPES_ON_CPU = ("fp32", "fp16")
#: The dtypes each backend's CPU run covers. The two kernel backends share their MoE kernels and differ
#: in the dense path; each takes one dtype here (triton the rounding-prone fp16, csgmv the tight fp32),
#: which halves their ~11-minute runs and still puts both dtypes through the shared kernels. Every
#: backend x dtype runs on the GPU matrix (ci/matrix.toml: conformance cells, bf16 / fp16 / fp32).
DTYPES_BY_BACKEND = {"reference": DTYPES_ON_CPU, "triton": ("fp16",), "csgmv": ("fp32",)}


def _installed(target: str) -> bool:
    module = target.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _failures(run) -> str:
    """What failed, with each failure's repro (the nested run's output is long)."""
    lines = [f"pytest exited {run.returncode} after {run.seconds:.0f} s"]
    for r in unexpected_failures(run.report or {"records": []}):
        repro = r.get("repro") or {}
        lines += [f"{r['test']}: {r['message']}", *(f"    {t}" for t in repro.get("trace", [])[:4]),
                  f"    replay: {repro.get('replay', '')}", f"    rerun: {repro.get('rerun', '')}"]
    return "\n".join(lines) + "\n--- output tail ---\n" + run.output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BUILTIN_BACKENDS))
def test_builtin_backend_passes_the_suite(backend, record_property):
    if not _installed(BUILTIN_BACKENDS[backend]):
        pytest.skip(f"{BUILTIN_BACKENDS[backend]} is not installed yet")
    budget = os.environ.get("MOELORA_MAX_EXAMPLES") or EXAMPLE_BUDGET.get(backend)
    # A private directory: pytest's tmp_path can be pruned by other pytest sessions during a long run.
    with tempfile.TemporaryDirectory(prefix=f"moelora-suite-{backend}-") as tmp:
        tmp_path = Path(tmp)
        dtypes = DTYPES_BY_BACKEND[backend]
        # items are named <mode>-<dtype> (graph families <decode|prefill>-<dtype>): -k selects by dtype
        extra = () if dtypes == DTYPES_ON_CPU else ("-k", " or ".join(dtypes))
        run = run_suite(backend, profile="interpret", report_json=tmp_path / "report.json",
                        max_examples=None if budget is None else int(budget), junitxml=tmp_path / "junit.xml",
                        extra=extra)
        record_property("seconds", round(run.seconds, 1))
        assert run.report is not None, _failures(run)
        assert run.returncode == 0 and not unexpected_failures(run.report), _failures(run)
        cases = list(ET.parse(tmp_path / "junit.xml").getroot().iter("testcase"))
    tagged = {p.get("value") for c in cases for p in c.iter("property") if p.get("name") == "moelora_property"}
    assert tagged == set(PROPERTIES), tagged
    records = run.report["records"]
    expected = {(p.id, mode, dt) for p in PROPERTIES.values() for mode in p.modes for dt in dtypes}
    assert {(r["property"], r["mode"], r["dtype"]) for r in records} == expected
    assert run.report["manifest"] is None and not run.report["manifest_unmatched"]
    if backend == "reference":
        assert {r["outcome"] for r in records} == {"passed"}, run.report["summary"]
    else:
        assert {r["outcome"] for r in records} <= {"passed", "not_implemented"}, run.report["summary"]
