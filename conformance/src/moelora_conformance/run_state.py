"""The state of one conformance run, kept in pytest's ``config.stash`` (no module globals).

:class:`RunState` holds the session's :class:`~moelora_conformance.properties.support.Suite`, the
Hypothesis settings every property runs with (built here from the profile and the command line,
applied to each property explicitly: nothing is registered or loaded into Hypothesis' global
profile table, and the profile table is never changed), the search seed, the manifest, the records
of the JSON report and the run's log file. The plugin reads it with :func:`run_state`.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from moelora_conformance.manifest import EMPTY, Manifest
from moelora_conformance.profiles import PROFILES, Profile, on_ci
from moelora_conformance.properties.support import Suite


@dataclass
class RunState:
    """One run's configuration and results.

    Attributes:
        profile: the profile in force (with ``--repro-caps``: the named profile with another's caps).
        profile_name: ``--profile`` as given. caps_profile: the profile whose caps the run uses.
        settings: the Hypothesis settings applied to every property.
        max_examples: the run's ``--max-examples`` / ``MOELORA_MAX_EXAMPLES`` override, or None.
        seed: the search seed every property runs with (``--hypothesis-seed``, or drawn by the plugin
            so a failure's rerun line can name it); None when the search is derandomized.
        seed_forced: the seed came from ``--hypothesis-seed``.
        suite: the session's suite (backend, capabilities, caps), once configured.
        manifest: expected failures. unmatched: entries that matched no collected item.
        records: nodeid → JSON record (the controller's, under xdist).
        started: wall-clock start (``time.time()``).
        log: the run's log file (full Hypothesis output of failures, warnings).
        diagnosis: why a run executed nothing (set at the end), or None.
        decorated: ids of the property functions the settings were applied to.
    """

    profile: Profile
    profile_name: str
    caps_profile: str
    settings: settings
    max_examples: int | None
    seed: int | None
    seed_forced: bool
    suite: Suite | None = None
    manifest: Manifest = EMPTY
    unmatched: list[str] = field(default_factory=list)
    records: dict[str, dict] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    log: Path | None = None
    diagnosis: str | None = None
    decorated: set[int] = field(default_factory=set)

    @property
    def derandomized(self) -> bool:
        return bool(self.settings.derandomize)


RUN_STATE = pytest.StashKey[RunState]()


def run_state(config: pytest.Config) -> RunState | None:
    """The run's state (None before the plugin configured it, or without the plugin)."""
    return config.stash.get(RUN_STATE, None)


def _option(config: pytest.Config, name: str, env: str | None = None, default=None):
    value = config.getoption(name)
    if value is None and env is not None:
        value = os.environ.get(env) or None
    return default if value is None else value


def max_examples_override(config: pytest.Config) -> int | None:
    """``--max-examples`` or ``MOELORA_MAX_EXAMPLES`` (None: the profile's)."""
    value = _option(config, "moelora_max_examples", "MOELORA_MAX_EXAMPLES")
    return None if value is None else int(value)


def build_run_state(config: pytest.Config) -> RunState:
    """The run's profile, Hypothesis settings and seed from the command line.

    Raises:
        pytest.UsageError: an unknown profile (``--profile`` or ``--repro-caps``).
    """
    name = _option(config, "moelora_profile", "MOELORA_PROFILE", "dev")
    caps_from = config.getoption("moelora_repro_caps") or name
    for n in (name, caps_from):
        if n not in PROFILES:
            raise pytest.UsageError(f"unknown moelora profile {n!r}; known: {sorted(PROFILES)}")
    profile = PROFILES[name]
    if caps_from != name:
        profile = replace(profile, name=f"{name}+{caps_from}-caps", caps=PROFILES[caps_from].caps)
    forced = config.getoption("hypothesis_seed", None)
    if forced is not None:
        # an explicit seed asks for that random search (a "rerun the search" line), on CI too
        derandomize = False
    else:
        # strict expected failures need the same search every run: a random search may miss a known
        # fault on one run, and the entry's XPASS(strict) would then fail CI at random
        derandomize = on_ci() or bool(config.getoption("moelora_manifest"))
    overrides: dict[str, object] = {"derandomize": derandomize}
    budget = max_examples_override(config)
    if budget is not None:
        overrides["max_examples"] = budget
    if config.getoption("moelora_no_shrink"):
        overrides["phases"] = (Phase.explicit, Phase.generate)
    hyp = settings(profile.settings(), **overrides)
    seed = None
    if forced is not None:
        try:
            seed = int(forced)
        except ValueError:
            seed = None
    elif not derandomize:
        seed = random.SystemRandom().getrandbits(32)
    state = RunState(profile, name, caps_from, hyp, budget, seed, forced is not None)
    state.log = _log_path(config)
    return state


def _log_path(config: pytest.Config) -> Path:
    """``--moelora-log``, else beside ``--report-json`` (``<stem>.log``), else a temporary file."""
    explicit = config.getoption("moelora_log")
    if explicit:
        return Path(explicit)
    report = config.getoption("moelora_report_json")
    if report:
        return Path(report).with_suffix(".log")
    return Path(tempfile.gettempdir()) / f"moelora-conformance-{os.getpid()}.log"
