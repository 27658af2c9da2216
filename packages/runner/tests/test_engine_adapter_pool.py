"""The adapter pool inside the engine: slots on demand, LRU eviction that never evicts an adapter a
running request uses, pinning, zero-on-reuse, reload semantics, in-memory loads, the backend's
slot-load hook.

Covers: the least recently used free-to-evict adapter is the one replaced; a long request keeps its
slot while other adapters cycle through the rest; a pinned adapter is never evicted, and a request
whose adapter can never get a slot (every slot pinned by others) fails with ``NoFreeSlotError`` rather
than waiting forever; a slot reused by an adapter lacking modules is zero there in every layer (and
serves exactly what a never-used slot serves); a reload once free serves the new weights from the same
slot; ``load_adapter_from_tensors`` serves exactly what the same files serve; a third-party backend
("module:factory") gets every load, reload and clear through its hook, once per layer pool.
"""

from __future__ import annotations

import json

import pytest
import runner_support as rs
import torch
from safetensors.torch import load_file

from moelora_core import assert_logprobs_close
from moelora_runner import NoFreeSlotError

MODEL = "qwen3_moe"


def _name(suffix):
    return f"{MODEL}-{suffix}"


def _req(adapter, rid, n=4, max_new=2, **kw):
    return dict(request_id=rid, prompt_token_ids=list(range(7, 7 + n)), adapter=adapter, max_new_tokens=max_new,
                ignore_eos=True, **kw)


def test_lru_adapter_is_evicted(make_engine):
    engine = make_engine(MODEL, max_loras=2)
    a, b, c = _name("eng-fused-r8"), _name("eng-legacy-r3"), _name("eng-rslora-r6")
    engine.generate([_req(a, "a")])
    engine.generate([_req(b, "b")])
    engine.generate([_req(a, "a2")])  # a is now more recent than b
    engine.generate([_req(c, "c")])
    assert set(engine.adapters.slots()) == {a, c}
    assert engine.metrics_.value("moelora_adapter_evictions_total") == 1
    assert engine.metrics_.value("moelora_adapter_loads_total") == 3


def test_adapter_of_a_running_request_is_never_evicted(make_engine, engine_adapters):
    engine = make_engine(MODEL, max_loras=2, max_num_batched_tokens=32)
    rec = rs.StepRecorder(engine)
    long_name = _name("eng-fused-r8")
    others = [n for n, _ in engine_adapters[MODEL] if n != long_name]
    requests = [_req(long_name, "long", max_new=14)] + [_req(n, f"o{i}", n=3, max_new=1) for i, n in enumerate(others)]
    outputs = engine.generate(requests)
    long_slot = {s.batch_spec.requests[s.request_ids.index("long")].slot for s in rec.steps if "long" in s.request_ids}
    assert len(long_slot) == 1  # the same slot every step it ran
    assert engine.metrics_.value("moelora_adapter_evictions_total") >= 2  # the others cycled through one slot
    alone = make_engine(MODEL, max_loras=2).generate([requests[0]])[0]
    assert outputs[0].output_token_ids == alone.output_token_ids
    assert_logprobs_close(outputs[0].output_logprobs, alone.output_logprobs, comparison="batched_vs_alone",
                             dtype="float32", what="long")


def test_pinned_adapter_is_never_evicted(make_engine, engine_adapters):
    engine = make_engine(MODEL, max_loras=2)
    pinned = _name("eng-attn-r5-fp16")
    engine.pin(pinned)
    slot = engine.adapters.slot_of(pinned)
    for i, (name, _) in enumerate(engine_adapters[MODEL]):
        engine.generate([_req(name, f"x{i}")])
        assert engine.adapters.slot_of(pinned) == slot
    engine.unpin(pinned)
    engine.generate([_req(_name("eng-fused-r8"), "y"), _req(_name("eng-legacy-r3"), "z")])
    assert engine.adapters.slot_of(pinned) is None  # evictable again


def test_request_for_an_adapter_that_can_never_get_a_slot_fails(make_engine):
    engine = make_engine(MODEL, max_loras=2)
    engine.pin(_name("eng-fused-r8"))
    engine.pin(_name("eng-legacy-r3"))
    with pytest.raises(NoFreeSlotError, match="pinned or used by running"):
        engine.pin(_name("eng-rslora-r6"))
    out = engine.generate([_req(_name("eng-rslora-r6"), "never"), _req(None, "base")])
    assert out[0].finish_reason == "error" and out[0].error["type"] == "NoFreeSlotError"
    assert "unpin one" in out[0].error["message"]
    assert out[1].finish_reason == "length"
    assert not engine.has_unfinished() and engine.kv.free_tokens == engine.kv.num_tokens


def test_reused_slot_is_zeroed_for_every_module_the_new_adapter_lacks(make_engine):
    full, attn = _name("eng-fused-r8"), _name("eng-attn-r5-fp16")
    engine = make_engine(MODEL, max_loras=1)
    engine.generate([_req(full, "full")])
    assert engine.adapters.slots() == (full,)
    got = engine.generate([_req(attn, "attn", prompt_logprobs=True)])[0]
    assert engine.adapters.slots() == (attn,)
    for pool in engine.adapters.pools:
        for module in ("gate", "up", "down"):
            A, B = pool.factors(module)
            assert not A[0].any() and not B[0].any() and pool.host_ranks[module][0] == 0
            assert float(pool.scalings(module)[0]) == 0.0
        assert pool.host_ranks["q"][0] == 5
    fresh = make_engine(MODEL, max_loras=1).generate([_req(attn, "attn", prompt_logprobs=True)])[0]
    assert got.output_token_ids == fresh.output_token_ids
    assert torch.equal(torch.tensor(got.prompt_logprobs[1:] + got.output_logprobs),
                       torch.tensor(fresh.prompt_logprobs[1:] + fresh.output_logprobs))


def test_reload_once_free_serves_the_new_weights_from_the_same_slot(make_engine, engine_adapters):
    dirs = dict(engine_adapters[MODEL])
    engine = make_engine(MODEL, adapters=False, max_loras=2)
    engine.load_adapter("live", dirs[_name("eng-fused-r8")])
    old = engine.generate([_req("live", "1", prompt_logprobs=True)])[0]
    slot = engine.adapters.slot_of("live")
    engine.load_adapter("live", dirs[_name("eng-pattern-r4")])  # a new version of "live"
    assert engine.adapters.slot_of("live") == slot and engine.adapters.slots().count("live") == 1
    new = engine.generate([_req("live", "2", prompt_logprobs=True)])[0]
    ref = make_engine(MODEL, adapters=False, max_loras=2)
    ref.load_adapter("v2", dirs[_name("eng-pattern-r4")])
    want = ref.generate([_req("v2", "3", prompt_logprobs=True)])[0]
    assert new.output_logprobs == want.output_logprobs and new.prompt_logprobs == want.prompt_logprobs
    assert new.prompt_logprobs != old.prompt_logprobs


def test_in_memory_tensors_serve_what_the_files_serve(make_engine, engine_adapters):
    path = dict(engine_adapters[MODEL])[_name("eng-legacy-r3")]
    tensors = load_file(str(path / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    engine = make_engine(MODEL, adapters=False, max_loras=2)
    engine.load_adapter("disk", path)
    engine.load_adapter_from_tensors("memory", tensors, config)
    assert engine.adapters.get("memory").source == "<tensors>"
    disk, memory = engine.generate([_req("disk", "d", prompt_logprobs=True), _req("memory", "m", prompt_logprobs=True)])
    assert disk.output_token_ids == memory.output_token_ids
    assert_logprobs_close(memory.prompt_logprobs[1:] + memory.output_logprobs,
                             disk.prompt_logprobs[1:] + disk.output_logprobs, comparison="batched_vs_alone",
                             dtype="float32", what="memory vs disk")
    for pool in engine.adapters.pools:  # the same factors in both slots
        for module in ("gate", "up", "down", "o"):
            A, B = pool.factors(module)
            assert torch.equal(A[0], A[1]) and torch.equal(B[0], B[1])


def test_third_party_backend_hears_every_slot_load_reload_and_clear(make_engine, engine_adapters):
    rs.HOOK_CALLS.clear()
    dirs = dict(engine_adapters[MODEL])
    engine = make_engine(MODEL, adapters=False, backend="runner_support:make_hooked_backend", max_loras=2)
    assert engine.backend.name == "hooked-reference"
    pools = {id(p) for p in engine.adapters.pools}
    engine.load_adapter("a", dirs[_name("eng-fused-r8")])
    assert rs.HOOK_CALLS == []  # registered only; no slot yet
    engine.generate([_req("a", "1")])
    slot = engine.adapters.slot_of("a")
    assert {(s, p) for _, s, p in rs.HOOK_CALLS} == {(slot, p) for p in pools} and len(rs.HOOK_CALLS) == len(pools)
    rs.HOOK_CALLS.clear()
    engine.load_adapter("a", dirs[_name("eng-legacy-r3")])  # reload in place
    engine.unload_adapter("a")  # clear
    assert len(rs.HOOK_CALLS) == 2 * len(pools) and {s for _, s, _ in rs.HOOK_CALLS} == {slot}
