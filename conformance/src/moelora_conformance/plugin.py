"""The pytest plugin of the conformance suite (DESIGN.md §7).

    pytest -p moelora_conformance.plugin --backend module:factory [--profile NAME] [--device cpu|cuda]
           [--manifest expected.toml] [--report-json results.json] [--junitxml results.xml]

- ``--backend`` (or ``MOELORA_BACKEND``): ``module:factory`` or a built-in name (reference, triton,
  csgmv). The factory is called once on a tiny spec to read the capabilities.
- ``--profile`` (default ``MOELORA_PROFILE`` or ``dev``): the moelora profile; its Hypothesis
  settings are applied to every property explicitly (never Hypothesis' built-in ``ci``, nothing
  registered globally); ``--max-examples N`` (or ``MOELORA_MAX_EXAMPLES``) overrides its example
  count (a per-backend budget), ``--no-shrink`` runs the explicit and generate phases only.
- ``--device`` (or ``MOELORA_DEVICE``, default cpu).
- ``--manifest``: expected failures (:mod:`moelora_conformance.manifest`) → ``xfail(strict=True)``.
- ``--report-json``: the JSON report (:mod:`moelora_conformance.report`); ``--moelora-log``: the
  log file of full failure reports and warnings (default: beside the JSON report).
- ``--moelora-replay VERSION:BLOB`` with ``--repro-caps PROFILE``: replay one failing example
  (the repro line of a failure prints both).

Without path arguments the suite's own property modules are collected, so the one-line command
works from any directory. Each property is parametrized over its harness modes and the profile's
dtypes; what the backend does not declare is skipped with a reason starting "not implemented".
Items run in ``registry.RUN_ORDER``: the metadata-only properties (P06, P07) first, fp32 before
fp16, then the items that catch the most faults per second.

Results are honest (:mod:`moelora_conformance.report`): every collected item is recorded as
``not_run`` until its call phase passed; a run in which no item executed exits 5 and says why
(:mod:`moelora_conformance.diagnosis`). The run's state lives in ``config.stash``
(:mod:`moelora_conformance.run_state`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import reproduce_failure, seed
from hypothesis import settings as hypothesis_settings
from hypothesis.errors import DidNotReproduce

from moelora_conformance.diagnosis import executed_nothing, no_run_cause
from moelora_conformance.failures import RunLog, failure_text, first_line, hypothesis_output
from moelora_conformance.harness.checks import OracleMismatch
from moelora_conformance.hypothesis_compat import shrink_time_limit
from moelora_conformance.manifest import Manifest, load_manifest
from moelora_conformance.profiles import PROFILES
from moelora_conformance.properties import support
from moelora_conformance.properties.registry import MARKER, PROPERTIES, item_fields, property_of, run_order
from moelora_conformance.report import NOT_IMPLEMENTED, NOT_RUN, new_record, record_phase, summarize
from moelora_conformance.report_header import backend_origin, build_report, header_lines
from moelora_conformance.repro import build_repro, distinct_failures, extract_blob
from moelora_conformance.run_state import RUN_STATE, RunState, build_run_state, run_state
from moelora_conformance.strategies.shapes import DTYPE_NAMES
from moelora_conformance.strategies.suite import family_of, suite_caps
from moelora_core.backend import check_protocol, load_backend
from moelora_core.capabilities import Capabilities
from moelora_core.errors import InvalidFieldError, RenamedError
from moelora_core.layer_spec import LoRALayerSpec

PROPERTIES_DIR = Path(__file__).resolve().parent / "properties"
#: Above this token cap the per-token oracle checks a bounded number of rows per run.
ORACLE_ALL_ROWS_UP_TO = 512
ORACLE_ROWS = 16


# --- options ------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moelora", "moelora conformance suite")
    group.addoption("--backend", "--moelora-backend", dest="moelora_backend", default=None,
                    help="backend under test: module:factory or reference/triton/csgmv (default $MOELORA_BACKEND)")
    group.addoption("--profile", "--moelora-profile", dest="moelora_profile", default=None,
                    help=f"moelora profile {sorted(PROFILES)} (default $MOELORA_PROFILE or dev)")
    group.addoption("--device", "--moelora-device", dest="moelora_device", default=None,
                    help="cpu or cuda (default $MOELORA_DEVICE or cpu)")
    group.addoption("--manifest", "--moelora-manifest", dest="moelora_manifest", default=None,
                    help="TOML manifest of expected failures")
    group.addoption("--report-json", dest="moelora_report_json", default=None, help="write the JSON report here")
    group.addoption("--moelora-log", dest="moelora_log", default=None,
                    help="log file of full failure reports and warnings (default: beside --report-json)")
    group.addoption("--max-examples", dest="moelora_max_examples", type=int, default=None,
                    help="examples per property item (default: the profile's, or $MOELORA_MAX_EXAMPLES)")
    group.addoption("--no-shrink", dest="moelora_no_shrink", action="store_true", default=False,
                    help="run Hypothesis' explicit and generate phases only (no shrinking)")
    group.addoption("--moelora-replay", dest="moelora_replay", default=None,
                    help="VERSION:BLOB of a failing example to replay (from a repro line)")
    group.addoption("--repro-caps", dest="moelora_repro_caps", default=None,
                    help="with --profile repro: use this profile's size caps (the failing run's)")


# --- configuration ----------------------------------------------------------------------------


def _probe_capabilities(factory, device: torch.device) -> tuple[str, str, Capabilities]:
    spec = LoRALayerSpec(hidden_size=8, moe_intermediate_size=8, num_experts=2, top_k=1, dense_shapes={},
                         max_loras=1, max_rank=1, dtype=torch.float32, device=device)
    backend = factory(spec)
    caps = backend.capabilities()
    if not isinstance(caps, Capabilities):
        raise pytest.UsageError(f"capabilities() of the backend returned {type(caps).__name__}, not Capabilities")
    try:
        check_protocol(backend)  # a backend written for the previous protocol: name what replaces it
    except RenamedError as exc:
        raise pytest.UsageError(str(exc)) from None
    return getattr(backend, "name", "?"), str(getattr(backend, "version", "?")), caps


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(id): a moelora conformance property (parametrized by the plugin)")
    target = config.getoption("moelora_backend") or os.environ.get("MOELORA_BACKEND") or None
    if target is None:
        raise pytest.UsageError("moelora_conformance.plugin: name the backend under test with --backend "
                                "module:factory (or a built-in: reference, triton, csgmv) or MOELORA_BACKEND")
    device = torch.device(config.getoption("moelora_device") or os.environ.get("MOELORA_DEVICE") or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device is available")
    state = build_run_state(config)
    worker = getattr(config, "workerinput", None)
    if worker is not None and "moelora_log" in worker:  # an xdist worker: the controller's seed and log
        state.seed, state.log = worker["moelora_seed"], Path(worker["moelora_log"])
    config.stash[RUN_STATE] = state
    try:
        factory = load_backend(target)
    except InvalidFieldError as exc:
        raise pytest.UsageError(f"--backend: {exc}") from None
    name, version, caps = _probe_capabilities(factory, device)
    profile = state.profile
    oracle_rows = None if profile.caps.max_tokens <= ORACLE_ALL_ROWS_UP_TO else ORACLE_ROWS
    state.suite = support.Suite(target=target, factory=factory, name=name, version=version, capabilities=caps,
                                device=device, profile=profile, caps=suite_caps(profile.caps, caps),
                                oracle_rows=oracle_rows, origin=backend_origin(target, factory),
                                workdir=Path(tempfile.mkdtemp(prefix="moelora-suite-files-")))
    try:
        state.manifest = load_manifest(config.getoption("moelora_manifest"), set(PROPERTIES))
    except InvalidFieldError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not config.option.file_or_dir:
        # No paths given: collect the suite's own property modules, wherever pytest was started.
        config.args[:] = [str(PROPERTIES_DIR)]
    config.pluginmanager.register(_Recorder(state), "moelora-recorder")


def pytest_unconfigure(config: pytest.Config) -> None:
    state = run_state(config)
    if state is not None and state.suite is not None and state.suite.workdir is not None:
        shutil.rmtree(state.suite.workdir, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = run_state(config)
    return [] if state is None or state.suite is None else header_lines(state)


@pytest.fixture(scope="session")
def moelora_suite(request: pytest.FixtureRequest) -> support.Suite:
    """The session's :class:`~moelora_conformance.properties.support.Suite`."""
    return request.config.stash[RUN_STATE].suite


# --- parametrization, skips, manifest, settings ---------------------------------------------------


def _dtypes(suite: support.Suite) -> list[torch.dtype]:
    # bf16 only on CUDA: the CPU paths (the Triton interpreter) compute it wrongly.
    return [d for d in suite.profile.caps.dtypes if d is not torch.bfloat16 or suite.device.type == "cuda"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    prop = PROPERTIES[marker.args[0]]
    suite = metafunc.config.stash[RUN_STATE].suite
    params, ids = [], []
    for mode in prop.modes:
        for dtype in _dtypes(suite):
            params.append((mode, dtype))
            ids.append(f"{mode}-{DTYPE_NAMES[dtype]}")
    metafunc.parametrize(("mode", "dtype"), params, ids=ids)


def _params(item: pytest.Item) -> tuple[str, str] | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "mode" not in callspec.params:
        return None
    return callspec.params["mode"], DTYPE_NAMES[callspec.params["dtype"]]


def not_implemented_reason(suite: support.Suite, prop, mode: str, dtype: torch.dtype) -> str | None:
    """Why the backend cannot run this item, from its declared capabilities (None = it can)."""
    caps = suite.capabilities
    if suite.device.type not in caps.devices:
        return f"{NOT_IMPLEMENTED}: device {suite.device.type} (declares {sorted(caps.devices)})"
    if dtype not in caps.dtypes:
        return f"{NOT_IMPLEMENTED}: dtype {DTYPE_NAMES[dtype]}"
    family = family_of(mode)
    if family is not None and family not in caps.graph_families:
        return f"{NOT_IMPLEMENTED}: {family} graph family"
    if mode.startswith("prefill-") and mode.removeprefix("prefill-") not in caps.prefill_graph_modes:
        return f"{NOT_IMPLEMENTED}: prefill graph mode {mode.removeprefix('prefill-')}"
    if prop.capability is not None and not getattr(caps, prop.capability):
        return f"{NOT_IMPLEMENTED}: {prop.capability.replace('_', ' ')}"
    return None


def not_run_reason(prop) -> str | None:
    """Why the suite cannot run this property here (a module it needs is missing), or None."""
    missing = [m for m in prop.requires if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{NOT_RUN}: needs {', '.join(missing)} (pip install 'moelora-conformance[fixtures]')")
    return None


def _decorate(state: RunState, config: pytest.Config, fn) -> None:
    """Apply the run's Hypothesis settings, seed and replay to a property function (once: the items
    of its modes and dtypes share it), with Hypothesis' public decorators."""
    if id(fn) in state.decorated:
        return
    state.decorated.add(id(fn))
    hypothesis_settings(state.settings)(fn)
    if state.seed is not None and not state.seed_forced:
        seed(state.seed)(fn)
    replay = config.getoption("moelora_replay")
    if replay:
        version, _, blob = replay.partition(":")
        reproduce_failure(version, blob.encode())(fn)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[RUN_STATE]
    suite = state.suite
    manifest: Manifest = state.manifest
    used: set[int] = set()
    for item in items:
        prop = property_of(item)
        params = _params(item)
        if prop is None or params is None:
            continue
        _decorate(state, config, item.obj)
        mode, dtype_name = params
        reason = not_implemented_reason(suite, prop, mode, item.callspec.params["dtype"]) or not_run_reason(prop)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        entry = manifest.match(prop.id, mode, dtype_name)
        if entry is not None:
            used.add(entry.index)
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"manifest: {entry.reason}"))
    # registry.RUN_ORDER: metadata first, fp32 first, the most productive properties first
    items.sort(key=lambda it: run_order(property_of(it).id, *_params(it)) if property_of(it) and _params(it)
               else (2, 0, 0, 0))
    state.unmatched = [e.describe() for e in manifest.entries if e.index not in used]
    for text in state.unmatched:
        warnings.warn(pytest.PytestWarning(f"moelora manifest {manifest.path}: {text} matched no test"),
                      stacklevel=1)


# --- results: records, repro sections, JSON -------------------------------------------------------


def _item_info(item: pytest.Item, state: RunState) -> dict | None:
    prop, params = property_of(item), _params(item)
    if prop is None or params is None:
        return None
    return {"property": prop.id, "title": prop.title, "mode": params[0], "dtype": params[1], "test": item.name,
            "max_examples": state.settings.max_examples}


#: What a replay (``--moelora-replay``) whose example now passes reports: the item passes.
REPLAY_GONE = "did not reproduce: the failure is gone (the replayed example passes every check)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Run a property item with the profile's shrink bound and its warnings kept out of the terminal
    (logged; :mod:`moelora_conformance.failures`).

    A replay (``--moelora-replay``) whose example no longer fails is what a fix looks like: Hypothesis
    raises ``DidNotReproduce`` ("completed successfully"), which is reported as :data:`REPLAY_GONE` and
    the item passes. A blob that no longer fits the test's draws (the suite changed since it was
    printed) replays nothing: the item is ``not_run`` with that reason."""
    state = run_state(item.config)
    if state is None or property_of(item) is None:
        return (yield)
    with warnings.catch_warnings(record=True) as caught, shrink_time_limit(state.profile.shrink_seconds):
        warnings.simplefilter("always")
        try:
            return (yield)
        except DidNotReproduce as exc:
            if not item.config.getoption("moelora_replay"):
                raise
            if "completed successfully" in str(exc):
                item.user_properties.append(("moelora_replay", REPLAY_GONE))
                return None
            pytest.skip(f"{NOT_RUN}: did not reproduce: the blob does not fit this test's draws any more ({exc}); "
                        "rerun the search with the rerun line")
        finally:
            if caught and state.log is not None:
                item.user_properties.append(("moelora_warnings", RunLog(state.log).warnings(item.nodeid, caught)))
            if state.suite is not None and state.suite.device.type == "cuda":
                # Hand the item's cached blocks back: a run holds its largest item's peak otherwise
                # (56 GiB seen), and the GPU matrix runs several suites on one GPU (run --jobs).
                gc.collect()
                torch.cuda.empty_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report: pytest.TestReport = yield
    state = run_state(item.config)
    info = None if state is None else _item_info(item, state)
    if info is None:
        return report
    if report.failed and call.when == "call" and call.excinfo is not None and not hasattr(report, "wasxfail"):
        _summarize_failure(item, call, report, state, info)  # (a strict XPASS has no exception: kept as is)
    if call.when == "setup":
        # JUnit (--junitxml) writes the item's user properties as <property> elements of its test case.
        item.user_properties += [("moelora_property", info["property"]), ("moelora_mode", info["mode"]),
                                 ("moelora_dtype", info["dtype"])]
    report.user_properties.append(("moelora", json.dumps(info)))
    return report


def _summarize_failure(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport, state: RunState,
                       info: dict) -> None:
    """Attach the repro to the failing item's record and print the short failure text instead of
    Hypothesis' full report (which goes to the log)."""
    suite = state.suite
    exc = call.excinfo.value if call.excinfo is not None else None
    failures = distinct_failures(exc)
    repro = build_repro(test=item.name, backend=suite.target, device=str(suite.device), profile=state.profile_name,
                        caps_profile=state.caps_profile, hypothesis_seed=state.seed,
                        blobs=[extract_blob(f) for f in failures], traces=[support.trace_lines(f) for f in failures],
                        messages=[first_line(f) for f in failures], derandomized=state.derandomized,
                        max_examples=state.max_examples, no_shrink=item.config.getoption("moelora_no_shrink"))
    full = str(report.longrepr)
    log = RunLog(state.log) if state.log is not None else None
    if log is not None:
        captured = "\n".join(f"--- {name} ---\n{hypothesis_output(text)}" for name, text in report.sections)
        log.write(f"failure of {item.nodeid}", f"{repro.text()}\n\n{full}\n\n{captured}")
    report.longrepr = failure_text(repro, failures, full, log)
    report.sections = [(name, text) for name, text in report.sections if "Captured" not in name]
    info["repro"] = repro.as_dict()
    info["message"] = first_line(failures[0] if failures else exc)
    if failures and all(isinstance(f, OracleMismatch) for f in failures):
        info["check"] = "oracle"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


class _Recorder:
    """The hooks that fold reports into the run's records: in the only process, or in the xdist
    controller (workers' reports carry each item's fields in the "moelora" user property)."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def _expect(self, nodeids) -> None:
        for nodeid in nodeids:
            fields = item_fields(nodeid)
            if fields is not None and nodeid not in self.state.records:
                budget = self.state.settings.max_examples
                rec = self.state.records[nodeid] = new_record(nodeid, {**fields, "max_examples": budget})
                # Known before anything runs: an item of an undeclared capability is not implemented even
                # when the run stops (-x, an interrupt) before its skip is reported.
                reason = self._not_implemented(fields)
                if reason is not None:
                    rec["outcome"], rec["reason"] = "not_implemented", reason

    def _not_implemented(self, fields: dict) -> str | None:
        suite = self.state.suite
        dtype = next((d for d, name in DTYPE_NAMES.items() if name == fields["dtype"]), None)
        if suite is None or dtype is None or fields["property"] not in PROPERTIES:
            return None
        return not_implemented_reason(suite, PROPERTIES[fields["property"]], fields["mode"], dtype)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not hasattr(session.config, "workerinput"):
            self._expect(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._expect(ids)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        node.workerinput["moelora_seed"] = self.state.seed
        node.workerinput["moelora_log"] = str(self.state.log)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        info = next((json.loads(v) for k, v in report.user_properties if k == "moelora"), None)
        if info is None:
            fields = item_fields(report.nodeid)  # e.g. xdist's report of a crashed worker
            if fields is None:
                return
            info = fields
        text = str(report.longreprtext).strip().splitlines() if report.failed and report.longreprtext else []
        note = next((v for k, v in report.user_properties if k == "moelora_warnings"), None)
        replay = next((v for k, v in report.user_properties if k == "moelora_replay"), None)
        rec = record_phase(self.state.records, nodeid=report.nodeid, info=info, when=report.when,
                           passed=report.passed, failed=report.failed, skipped=report.skipped,
                           duration=report.duration, wasxfail=getattr(report, "wasxfail", None),
                           skip_reason=_skip_reason(report) if report.skipped else "",
                           last_line=(text[0] if text and text[0].startswith("[XPASS") else
                                      text[-1] if text else "")[:400])
        if note:
            rec["warnings"] = note
        if replay and rec["outcome"] == "passed":
            rec["message"] = replay


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = run_state(config)
    if state is None or state.suite is None or hasattr(config, "workerinput"):
        return  # an xdist worker: the controller decides and writes the report
    records = list(state.records.values())
    if not config.option.collectonly and exitstatus in (0, 5) and executed_nothing(records):
        suite = state.suite
        state.diagnosis = no_run_cause(records, device=str(suite.device),
                                       declared_devices=sorted(suite.capabilities.devices))
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
    path = config.getoption("moelora_report_json")
    if path:
        report = build_report(state, config)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    state = run_state(config)
    if state is None or not state.records:
        return
    tr = terminalreporter
    records = list(state.records.values())
    tr.section("moelora conformance")
    tr.write_line(", ".join(f"{n} {o}" for o, n in summarize(records).items()))
    for rec in records:
        if rec["outcome"] in ("failed", "xpassed") and rec.get("repro"):
            repro = rec["repro"]
            tr.write_line(f"{rec['test']} ({rec['property']}): {rec['message']}")
            for line in repro["trace"][:3]:
                tr.write_line(f"    {line}")
            for i, replay in enumerate(repro.get("replays") or [repro.get("replay")]):
                if replay:
                    tr.write_line(f"    replay{f' failure {i + 1}' if len(repro.get('replays', [])) > 1 else ''}: "
                                  f"{replay}")
            if repro.get("rerun"):
                tr.write_line(f"    rerun: {repro['rerun']}")
    for rec in records:
        if rec["outcome"] == "passed" and rec.get("message") == REPLAY_GONE:
            tr.write_line(f"moelora replay of {rec['test']}: {REPLAY_GONE}", green=True)
    cut = [r for r in records if r["outcome"] == "not_run" and not r.get("reason")]  # started, never finished
    if cut:
        tr.write_line(f"{len(cut)} items did not finish (not_run): " + ", ".join(r["test"] for r in cut[:6])
                      + (" ..." if len(cut) > 6 else ""))
    if state.log is not None and state.log.exists():
        tr.write_line(f"moelora log (full failure reports, warnings): {state.log}")
    for text in state.unmatched:
        tr.write_line(f"manifest entry matched no test: {text}")
    if state.diagnosis:
        tr.write_line("moelora: this run tested nothing (exit 5)", red=True, bold=True)
        for line in state.diagnosis.splitlines():
            tr.write_line(f"  {line}")
