"""Session-scoped cache of the real-checkpoint fixtures (tiny HF MoE models + PEFT adapters).

Built once per test session into the session's base temp directory and shared by the xdist
workers (a file lock makes the first worker build and the others wait), or taken from
``MOELORA_FIXTURES_DIR`` when that names a directory built by ``moelora-conformance make-fixtures``
(:mod:`moelora_conformance.fixtures.cache`). Tests that need it are skipped when transformers or
peft (the ``fixtures`` extra) is missing.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fixture_set(tmp_path_factory):
    """The :class:`moelora_conformance.fixtures.FixtureSet` of this session."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from moelora_conformance.fixtures.cache import session_fixture_set

    return session_fixture_set(tmp_path_factory)
