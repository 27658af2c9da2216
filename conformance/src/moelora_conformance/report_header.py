"""The report header: what a reader (and a replay) needs to know about a run.

The terminal header and the JSON report's header name the backend (name, version, the
``--backend`` target, the file its factory was imported from and the distribution that installed
it), its capabilities, the profile with its settings and caps, the manifest, every ``MOELORA_*``
variable and ``TRITON_INTERPRET`` (a Triton backend's CPU run depends on it).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import inspect
import json
import os
import platform
import sys

import pytest
import torch

from moelora_conformance import __version__
from moelora_conformance.report import summarize

#: Environment variables a replay needs besides ``MOELORA_*``.
REPLAY_VARIABLES = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "CI")


def backend_origin(target: str, factory) -> dict[str, str | None]:
    """{"module", "file", "distribution", "distribution_version"} of the backend's factory."""
    module = getattr(factory, "__module__", None) or target.partition(":")[0]
    try:
        file = inspect.getsourcefile(factory) or getattr(sys.modules.get(module), "__file__", None)
    except TypeError:
        file = getattr(sys.modules.get(module), "__file__", None)
    top = module.partition(".")[0]
    # an editable install maps no top-level name: try the distribution named like the package
    candidates = [*importlib.metadata.packages_distributions().get(top, []), top.replace("_", "-")]
    for dist in candidates:
        try:
            return {"module": module, "file": file, "distribution": dist,
                    "distribution_version": importlib.metadata.version(dist)}
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"module": module, "file": file, "distribution": None, "distribution_version": None}


def run_environment() -> dict[str, str]:
    """Every ``MOELORA_*`` variable and those of :data:`REPLAY_VARIABLES` that are set."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOELORA_") or k in REPLAY_VARIABLES}


def header_lines(state) -> list[str]:
    """The terminal header of a run (``state``: the :class:`~moelora_conformance.run_state.RunState`)."""
    suite, hyp = state.suite, state.settings
    origin = suite.origin or {}
    dist = origin.get("distribution")
    seed = "derandomized" if state.seed is None else f"seed {state.seed}"
    lines = [
        f"moelora conformance {__version__}: backend {suite.name} {suite.version} ({suite.target}) on {suite.device}",
        f"  backend from: {origin.get('file') or origin.get('module')}"
        + (f" ({dist} {origin.get('distribution_version')})" if dist else ""),
        f"  capabilities: {json.dumps(suite.capabilities.as_dict())}",
        f"  profile: {suite.profile.name} (max_examples={hyp.max_examples}, phases={[p.name for p in hyp.phases]}, "
        f"{seed}, shrink limit {suite.profile.shrink_seconds or 'Hypothesis default'} s), caps: {suite.caps}",
        f"  manifest: {state.manifest.path or '(empty)'}",
    ]
    env = run_environment()
    if "TRITON_INTERPRET" not in env:
        env["TRITON_INTERPRET"] = "(unset)"
    lines.append("  environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    return lines


def build_report(state, config: pytest.Config) -> dict:
    """The JSON report of a run: header + records (sorted by property, mode, dtype)."""
    suite = state.suite
    records = sorted(state.records.values(), key=lambda r: (r["property"], r["mode"], r["dtype"]))
    versions = {"moelora_conformance": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for mod in ("hypothesis", "triton"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    hyp = state.settings
    return {
        "backend": {"name": suite.name, "version": suite.version, "target": suite.target, **(suite.origin or {})},
        "capabilities": suite.capabilities.as_dict(),
        "profile": suite.profile.name,
        "max_examples": hyp.max_examples,
        "phases": [p.name for p in hyp.phases],
        "derandomize": hyp.derandomize,
        "shrink_seconds": suite.profile.shrink_seconds,
        "device": str(suite.device),
        "device_name": torch.cuda.get_device_name(suite.device) if suite.device.type == "cuda" else platform.machine(),
        "environment": run_environment(),
        "manifest": str(state.manifest.path) if state.manifest.path else None,
        "manifest_unmatched": state.unmatched,
        "hypothesis_seed": state.seed,
        "started": _dt.datetime.fromtimestamp(state.started, _dt.UTC).isoformat(timespec="seconds"),
        "duration": _dt.datetime.now().timestamp() - state.started,
        "versions": versions,
        "diagnosis": state.diagnosis,
        "log": str(state.log) if state.log is not None else None,
        "summary": summarize(records),
        "records": records,
    }
