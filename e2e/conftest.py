"""Fixtures of the e2e tests: the session's fixture models (built once, shared with the runner and
conformance tests) and the engine adapters (``moelora_conformance.e2e.adapters``, the same shared
directory the runner tests use)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fixture_set(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from moelora_conformance.fixtures.cache import session_fixture_set

    return session_fixture_set(tmp_path_factory)


@pytest.fixture(scope="session")
def engine_adapters(tmp_path_factory, fixture_set):
    """model name → {adapter name: directory} of the engine adapters (five ranks and formats)."""
    from moelora_conformance.e2e.adapters import session_engine_adapters

    return {model: dict(dirs) for model, dirs in session_engine_adapters(tmp_path_factory).items()}
