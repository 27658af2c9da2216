"""Session-scoped cache of the real-checkpoint fixtures (tiny HF MoE models + PEFT adapters).

Built once per test session into the session's base temp directory and shared by the xdist
workers (a file lock makes the first worker build and the others wait), or taken from
``MOELORA_FIXTURES_DIR`` when that names a directory built by ``moelora-conformance make-fixtures``.
Tests that need it are skipped when transformers or peft (the ``fixtures`` extra) is missing.
"""

from __future__ import annotations

import fcntl
import os
import shutil

import pytest


@pytest.fixture(scope="session")
def fixture_set(tmp_path_factory):
    """The :class:`moelora_conformance.fixtures.FixtureSet` of this session."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from moelora_conformance.fixtures import build_fixtures, load_fixtures

    prebuilt = os.environ.get("MOELORA_FIXTURES_DIR")
    if prebuilt:
        return load_fixtures(prebuilt)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    target = shared / "moelora-fixtures"
    with open(shared / "moelora-fixtures.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / "manifest.json").is_file():
                staging = shared / f"moelora-fixtures.building-{os.getpid()}"
                build_fixtures(staging)
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)  # complete or absent, never half-built
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return load_fixtures(target)
