"""The engine on shared-outer and fully shared expert adapters (the fixtures' ``layout_adapters``).

Covers: an engine whose pool stores gate_up A and down B once per slot (``expert_layout=
"shared_outer"``) serving the four layout fixtures (3-D and 2-D encodings, shared-outer and fully
shared) plus base requests in one mixed run, each request's prompt and output logprobs against the
per-module reference built from the file's own tensors (peft cannot load these files; the
``engine_vs_hf`` tolerance row), on the reference backend and, in the interpreter, the triton and
csgmv backends; the pool's bytes per slot below the per-expert layout's; a per-expert adapter refused
by that pool with ``ExpertLayoutError`` and nothing changed; the same adapters served by a
default (per-expert) engine, where they are broadcast, with the same outputs; and peft itself
failing to load a 2-D shared-outer file.
"""

from __future__ import annotations

import pytest
import runner_support as rs

from moelora_conformance.e2e.engine_checks import PerModuleReference

MODEL = "qwen3_moe"


def _layout_adapters(fixture_set):
    return {n: fixture_set.layout_adapter_dir(n) for n, e in sorted(fixture_set.layout_adapters().items())
            if e["model"] == MODEL}


def _engine(make_engine, fixture_set, backend="reference", layout="shared_outer", **kw):
    engine = make_engine(MODEL, adapters=False, backend=backend, expert_layout=layout, max_loras=4, **kw)
    for name, path in _layout_adapters(fixture_set).items():
        engine.load_adapter(name, path)
    return engine


def test_layout_adapters_match_the_per_module_reference(fixture_set, make_engine):
    adapters = _layout_adapters(fixture_set)
    assert len(adapters) == 4
    engine = _engine(make_engine, fixture_set, max_num_batched_tokens=48)
    requests = rs.mixed_requests([None, *adapters], 20, seed=11, prompt_len=(1, 12), max_new_tokens=4,
                                 ignore_eos=True)
    outputs = engine.generate(requests)
    ref = PerModuleReference(fixture_set.model_dir(MODEL), adapters)
    counts = rs.check_against_hf(outputs, requests, ref, what="engine vs per-module reference")
    assert counts["compared"] >= 0.8 * counts["tokens"], counts
    # the same adapters broadcast into a per-expert pool: the same outputs, more bytes per slot
    wide = _engine(make_engine, fixture_set, layout="per_expert", max_num_batched_tokens=48)
    again = wide.generate(requests)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outputs]
    assert engine.adapters.slot_bytes() < wide.adapters.slot_bytes()


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "csgmv"])
def test_kernel_backends_read_the_shared_factors(backend, fixture_set, make_engine):
    adapters = _layout_adapters(fixture_set)
    engine = _engine(make_engine, fixture_set, backend=backend, max_num_batched_tokens=256)
    requests = rs.mixed_requests([None, *adapters], 10, seed=12, prompt_len=(1, 4), max_new_tokens=2,
                                 ignore_eos=True)
    outputs = engine.generate(requests)
    rs.check_against_hf(outputs, requests, PerModuleReference(fixture_set.model_dir(MODEL), adapters),
                        what=f"{backend} vs per-module reference")


def test_per_expert_adapter_is_refused_by_a_shared_outer_pool(fixture_set, make_engine):
    from moelora_core.checkpoint import ExpertLayoutError

    engine = _engine(make_engine, fixture_set)
    name = next(iter(_layout_adapters(fixture_set)))
    engine.generate(rs.mixed_requests([name], 1, seed=1, max_new_tokens=1))  # a slot in use
    before = rs.pool_snapshot(engine)
    with pytest.raises(ExpertLayoutError, match="once per slot"):
        engine.load_adapter("per-expert", fixture_set.adapter_dir(f"{MODEL}-r8"))
    rs.assert_snapshot_equal(before, rs.pool_snapshot(engine))
    assert "per-expert" not in engine.adapters


def test_peft_cannot_load_a_2d_shared_outer_file(fixture_set):
    from moelora_conformance.hf_check.hf_model import load_hf

    with pytest.raises(RuntimeError, match="size mismatch"):
        load_hf(fixture_set.model_dir(MODEL), fixture_set.layout_adapter_dir(f"{MODEL}-shared-outer-2d"))
