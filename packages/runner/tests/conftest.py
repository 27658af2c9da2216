"""Fixtures of the runner's tests: the session's fixture models (built once, shared with the
conformance tests), the engine adapters of :mod:`runner_support` (built once per session with the
fixtures builder: peft for fused adapters, hand-written legacy keys), and an engine factory that runs
every forward under the host-sync guard.

``MOELORA_RUNNER_DEVICE=cuda`` runs the engines of every test on the GPU (the host-sync guard is then
``torch.cuda.set_sync_debug_mode("error")``); the default is the CPU.
"""

from __future__ import annotations

import pytest
import runner_support as rs


@pytest.fixture(scope="session")
def fixture_set(tmp_path_factory):
    """The :class:`moelora_conformance.fixtures.FixtureSet` of this session."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from moelora_conformance.fixtures.cache import session_fixture_set

    return session_fixture_set(tmp_path_factory)


@pytest.fixture(scope="session")
def engine_adapters(tmp_path_factory, fixture_set):
    """model name → [(adapter name, directory)] of the engine adapters (:data:`runner_support.ENGINE_ADAPTERS`)."""
    from moelora_conformance.e2e.adapters import session_engine_adapters

    return session_engine_adapters(tmp_path_factory)


@pytest.fixture
def make_engine(fixture_set, engine_adapters):
    """``make_engine(model, adapters=True, **engine_kwargs)``: an Engine on fixture model ``model``
    with the host-sync guard on and (by default) its engine adapters loaded. Eager unless a test asks
    for graphs (``graph=`` / ``decode_graph=``), on CUDA too, so a test means the same everywhere."""

    def make(model: str, *, adapters: bool = True, **kwargs):
        from moelora_runner import Engine

        kwargs.setdefault("check_host_sync", True)
        kwargs.setdefault("device", rs.DEVICE)
        kwargs.setdefault("max_lora_rank", rs.POOL_RANK)
        kwargs.setdefault("graph", "eager")
        kwargs.setdefault("decode_graph", False)
        engine = Engine(fixture_set.model_dir(model), **kwargs)
        if adapters:
            for name, path in engine_adapters[model]:
                engine.load_adapter(name, path)
        return engine

    return make
