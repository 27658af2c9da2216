"""The pytest plugin of the conformance suite (issue 7, DESIGN.md §7).

    pytest -p moelora_conformance.plugin --backend module:factory [--profile NAME] [--device cpu|cuda]
           [--manifest expected.toml] [--report-json results.json] [--junitxml results.xml]

- ``--backend`` (or ``MOELORA_BACKEND``): ``module:factory`` or a built-in name (reference, triton,
  csgmv). The factory is called once on a tiny spec to read the capabilities.
- ``--profile`` (default ``MOELORA_PROFILE`` or ``dev``): the moelora Hypothesis profile, loaded by
  name (never Hypothesis' built-in ``ci``); ``--max-examples N`` (or ``MOELORA_MAX_EXAMPLES``)
  overrides its example count (a per-backend budget), ``--no-shrink`` runs the explicit and
  generate phases only.
- ``--device`` (or ``MOELORA_DEVICE``, default cpu).
- ``--manifest``: expected failures (:mod:`moelora_conformance.manifest`) → ``xfail(strict=True)``.
- ``--report-json``: the JSON report (:mod:`moelora_conformance.report`).
- ``--moelora-replay VERSION:BLOB`` with ``--repro-caps PROFILE``: replay one failing example
  (the repro line of a failure prints both).

Without path arguments the suite's own property modules are collected, so the one-line command
works from any directory. Each property is parametrized over its harness modes and the profile's
dtypes; what the backend does not declare is skipped with a reason starting "not implemented".
The metadata-only properties (P06, P07) run first.
The report header echoes the backend, its version and capabilities, and every ``MOELORA_*``
variable. A failure carries a repro section (seed, batch structure, replay command).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

from moelora_conformance import __version__
from moelora_conformance.harness.checks import OracleMismatch
from moelora_conformance.manifest import EMPTY, Manifest, load_manifest
from moelora_conformance.profiles import PROFILES, Profile, load_profile
from moelora_conformance.properties import registry, support
from moelora_conformance.properties.registry import MARKER, PROPERTIES, property_of
from moelora_conformance.report import NOT_IMPLEMENTED, record_phase, summarize
from moelora_conformance.repro import build_repro, extract_blob
from moelora_conformance.strategies.shapes import DTYPE_NAMES
from moelora_conformance.strategies.suite import family_of, suite_caps
from moelora_core.backend import load_backend
from moelora_core.capabilities import Capabilities
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import LoRALayerSpec

PROPERTIES_DIR = Path(__file__).resolve().parent / "properties"
#: Above this token cap the per-token oracle checks a bounded number of rows per run.
ORACLE_ALL_ROWS_UP_TO = 512
ORACLE_ROWS = 16

_SUITE = pytest.StashKey[support.Suite]()
_STATE = pytest.StashKey[dict]()


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
    group.addoption("--max-examples", dest="moelora_max_examples", type=int, default=None,
                    help="examples per property item (default: the profile's, or $MOELORA_MAX_EXAMPLES)")
    group.addoption("--no-shrink", dest="moelora_no_shrink", action="store_true", default=False,
                    help="run Hypothesis' explicit and generate phases only (no shrinking)")
    group.addoption("--moelora-replay", dest="moelora_replay", default=None,
                    help="VERSION:BLOB of a failing example to replay (from a repro line)")
    group.addoption("--repro-caps", dest="moelora_repro_caps", default=None,
                    help="with --profile repro: use this profile's size caps (the failing run's)")


def _option(config: pytest.Config, name: str, env: str | None = None, default=None):
    value = config.getoption(name)
    if value is None and env is not None:
        value = os.environ.get(env) or None
    return default if value is None else value


# --- configuration ----------------------------------------------------------------------------


def _load_settings(config: pytest.Config) -> Profile:
    """Load the moelora profile by name and apply the run's overrides as a derived profile."""
    name = _option(config, "moelora_profile", "MOELORA_PROFILE", "dev")
    caps_from = config.getoption("moelora_repro_caps")
    config.stash[_STATE]["profile_args"] = (name, caps_from or name)
    if caps_from:
        if caps_from not in PROFILES:
            raise pytest.UsageError(f"--repro-caps: unknown profile {caps_from!r}; known {sorted(PROFILES)}")
        derived = f"{name}+{caps_from}-caps"
        PROFILES[derived] = replace(PROFILES[name], name=derived, caps=PROFILES[caps_from].caps)
        name = derived
    try:
        profile = load_profile(name)
    except KeyError as exc:
        raise pytest.UsageError(str(exc.args[0])) from None
    overrides = {}
    max_examples = _max_examples(config)
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    if config.getoption("moelora_no_shrink"):
        overrides["phases"] = (Phase.explicit, Phase.generate)
    if config.getoption("hypothesis_seed", None) is not None:
        # an explicit seed asks for that random search (a "rerun the search" line), on CI too
        overrides["derandomize"] = False
    elif config.getoption("moelora_manifest"):
        # strict expected failures need the same search every run: a random search may miss a
        # known fault on one run, and the entry's XPASS(strict) would then fail CI at random
        overrides["derandomize"] = True
    name = f"moelora-{profile.name}"
    if overrides:
        settings.register_profile("moelora-run", parent=settings.get_profile(name), **overrides)
        name = "moelora-run"
    settings.load_profile(name)
    registry.SUITE_SETTINGS = settings.get_profile(name)
    return profile


def _probe_capabilities(factory, device: torch.device) -> tuple[str, str, Capabilities]:
    spec = LoRALayerSpec(hidden_size=8, moe_intermediate_size=8, num_experts=2, top_k=1, dense_shapes={},
                         max_loras=1, max_rank=1, dtype=torch.float32, device=device)
    backend = factory(spec)
    caps = backend.capabilities()
    if not isinstance(caps, Capabilities):
        raise pytest.UsageError(f"capabilities() of the backend returned {type(caps).__name__}, not Capabilities")
    return getattr(backend, "name", "?"), str(getattr(backend, "version", "?")), caps


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(id): a moelora conformance property (parametrized by the plugin)")
    state = {"records": {}, "unmatched": [], "started": time.time(), "manifest": EMPTY}
    config.stash[_STATE] = state
    target = _option(config, "moelora_backend", "MOELORA_BACKEND")
    if target is None:
        raise pytest.UsageError("moelora_conformance.plugin: name the backend under test with --backend "
                                "module:factory (or a built-in: reference, triton, csgmv) or MOELORA_BACKEND")
    device = torch.device(_option(config, "moelora_device", "MOELORA_DEVICE", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device is available")
    profile = _load_settings(config)
    try:
        factory = load_backend(target)
    except InvalidFieldError as exc:
        raise pytest.UsageError(f"--backend: {exc}") from None
    name, version, caps = _probe_capabilities(factory, device)
    oracle_rows = None if profile.caps.max_tokens <= ORACLE_ALL_ROWS_UP_TO else ORACLE_ROWS
    config.stash[_SUITE] = support.Suite(target, factory, name, version, caps, device, profile,
                                         suite_caps(profile.caps, caps), oracle_rows)
    try:
        state["manifest"] = load_manifest(config.getoption("moelora_manifest"), set(PROPERTIES))
    except InvalidFieldError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not config.option.file_or_dir:
        # No paths given: collect the suite's own property modules, wherever pytest was started.
        config.args[:] = [str(PROPERTIES_DIR)]


def pytest_report_header(config: pytest.Config) -> list[str]:
    suite = config.stash.get(_SUITE, None)
    if suite is None:
        return []
    lines = [
        f"moelora conformance {__version__}: backend {suite.name} {suite.version} ({suite.target}) on {suite.device}",
        f"  capabilities: {json.dumps(suite.capabilities.as_dict())}",
        f"  profile: {suite.profile.name} (max_examples={registry.SUITE_SETTINGS.max_examples}, "
        f"phases={[p.name for p in registry.SUITE_SETTINGS.phases]}, "
        f"derandomize={registry.SUITE_SETTINGS.derandomize}), caps: {suite.caps}",
        f"  manifest: {config.getoption('moelora_manifest') or '(empty)'}",
    ]
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOELORA_")}
    lines.append("  environment: " + (" ".join(f"{k}={v}" for k, v in env.items()) or "(no MOELORA_* variables)"))
    return lines


@pytest.fixture(scope="session")
def moelora_suite(request: pytest.FixtureRequest) -> support.Suite:
    """The session's :class:`~moelora_conformance.properties.support.Suite`."""
    return request.config.stash[_SUITE]


# --- parametrization, skips, manifest -----------------------------------------------------------


def _dtypes(suite: support.Suite) -> list[torch.dtype]:
    # bf16 only on CUDA: the CPU paths (the Triton interpreter) compute it wrongly.
    return [d for d in suite.profile.caps.dtypes if d is not torch.bfloat16 or suite.device.type == "cuda"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    prop = PROPERTIES[marker.args[0]]
    suite = metafunc.config.stash[_SUITE]
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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    suite = config.stash[_SUITE]
    state = config.stash[_STATE]
    manifest: Manifest = state["manifest"]
    used: set[int] = set()
    replay = config.getoption("moelora_replay")
    for item in items:
        prop = property_of(item)
        params = _params(item)
        if prop is None or params is None:
            continue
        mode, dtype_name = params
        reason = not_implemented_reason(suite, prop, mode, item.callspec.params["dtype"])
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        entry = manifest.match(prop.id, mode, dtype_name)
        if entry is not None:
            used.add(entry.index)
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"manifest: {entry.reason}"))
        if replay:
            version, _, blob = replay.partition(":")
            item.obj._hypothesis_internal_use_reproduce_failure = (version, blob)
    # Metadata-only properties first: cheap, and a metadata fault is then reported as one.
    items.sort(key=lambda it: 0 if (property_of(it) and property_of(it).metadata_only) else 1)
    state["unmatched"] = [e.describe() for e in manifest.entries if e.index not in used]
    for text in state["unmatched"]:
        warnings.warn(pytest.PytestWarning(f"moelora manifest {manifest.path}: {text} matched no test"),
                      stacklevel=1)


# --- results: records, repro sections, JSON -------------------------------------------------------


def pytest_runtest_setup(item: pytest.Item) -> None:
    support.TRACE.clear()


def _max_examples(config: pytest.Config) -> int | None:
    value = _option(config, "moelora_max_examples", "MOELORA_MAX_EXAMPLES")
    return None if value is None else int(value)


def _hypothesis_seed(item: pytest.Item) -> int | None:
    forced = item.config.getoption("hypothesis_seed", None)
    if forced is not None:
        try:
            return int(forced)
        except ValueError:
            return None
    fn = getattr(item, "obj", None)
    return getattr(fn, "_hypothesis_internal_use_generated_seed", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    prop, params = property_of(item), _params(item)
    if prop is None or params is None:
        return
    used = getattr(getattr(item, "obj", None), "_hypothesis_internal_use_settings", None)
    info = {"property": prop.id, "title": prop.title, "mode": params[0], "dtype": params[1], "test": item.name,
            "max_examples": getattr(used, "max_examples", None)}
    if report.failed and call.when == "call" and not hasattr(report, "wasxfail"):
        suite = item.config.stash[_SUITE]
        exc = call.excinfo.value if call.excinfo is not None else None
        profile, caps_profile = item.config.stash[_STATE]["profile_args"]
        repro = build_repro(test=item.name, backend=suite.target, device=str(suite.device), profile=profile,
                            caps_profile=caps_profile, hypothesis_seed=_hypothesis_seed(item),
                            blob=extract_blob(exc), trace=list(support.TRACE),
                            derandomized=bool(registry.SUITE_SETTINGS.derandomize),
                            max_examples=_max_examples(item.config))
        report.sections.append(("moelora repro", repro.text()))
        info["repro"] = repro.as_dict()
        info["message"] = _first_line(exc)
        if isinstance(exc, OracleMismatch):
            info["check"] = "oracle"
    if call.when == "setup":
        # JUnit (--junitxml) writes the item's user properties as <property> elements of its test case.
        item.user_properties += [("moelora_property", prop.id), ("moelora_mode", params[0]),
                                 ("moelora_dtype", params[1])]
    report.user_properties.append(("moelora", json.dumps(info)))


def _first_line(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Runs where the records are kept: the only process, or the xdist controller (the worker's
    # "moelora" user property carries the item's fields across).
    info = next((json.loads(v) for k, v in report.user_properties if k == "moelora"), None)
    if info is None or _CONFIG is None:
        return
    record_phase(_CONFIG.stash[_STATE]["records"], nodeid=report.nodeid, info=info, when=report.when,
                 passed=report.passed, failed=report.failed, skipped=report.skipped, duration=report.duration,
                 wasxfail=getattr(report, "wasxfail", None),
                 skip_reason=_skip_reason(report) if report.skipped else "",
                 last_line=str(report.longreprtext).strip().splitlines()[-1][:400] if report.failed and
                 report.longreprtext else "")


_CONFIG: pytest.Config | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _CONFIG
    _CONFIG = session.config


def build_report(config: pytest.Config, duration: float) -> dict:
    """The JSON report of this session (header + records)."""
    suite = config.stash[_SUITE]
    state = config.stash[_STATE]
    records = sorted(state["records"].values(), key=lambda r: (r["property"], r["mode"], r["dtype"]))
    versions = {"moelora_conformance": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for mod in ("hypothesis", "triton"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return {
        "backend": {"name": suite.name, "version": suite.version, "target": suite.target},
        "capabilities": suite.capabilities.as_dict(),
        "profile": suite.profile.name,
        "max_examples": registry.SUITE_SETTINGS.max_examples,
        "phases": [p.name for p in registry.SUITE_SETTINGS.phases],
        "derandomize": registry.SUITE_SETTINGS.derandomize,
        "device": str(suite.device),
        "device_name": torch.cuda.get_device_name(suite.device) if suite.device.type == "cuda" else platform.machine(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOELORA_")},
        "manifest": str(state["manifest"].path) if state["manifest"].path else None,
        "manifest_unmatched": state["unmatched"],
        "hypothesis_seed": config.getoption("hypothesis_seed", None),
        "started": _dt.datetime.fromtimestamp(state["started"], _dt.UTC).isoformat(timespec="seconds"),
        "duration": duration,
        "versions": versions,
        "summary": summarize(records),
        "records": records,
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller writes the report
        return
    path = config.getoption("moelora_report_json")
    if path and _SUITE in config.stash:
        report = build_report(config, time.time() - config.stash[_STATE]["started"])
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _STATE not in config.stash:
        return
    state = config.stash[_STATE]
    records = list(state["records"].values())
    if not records:
        return
    tr = terminalreporter
    tr.section("moelora conformance")
    counts = summarize(records)
    tr.write_line(", ".join(f"{n} {o}" for o, n in counts.items()))
    for rec in records:
        if rec["outcome"] in ("failed", "error") and rec.get("repro"):
            repro = rec["repro"]
            tr.write_line(f"{rec['test']} ({rec['property']}): {rec['message']}")
            for line in repro["trace"][:3]:
                tr.write_line(f"    {line}")
            for key in ("replay", "rerun"):
                if repro.get(key):
                    tr.write_line(f"    {key}: {repro[key]}")
    for text in state["unmatched"]:
        tr.write_line(f"manifest entry matched no test: {text}")
