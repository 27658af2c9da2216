"""Bad input to the engine: each gets a clear named error, and nothing else is disturbed.

Every case checks the error class, its message, and the pool / KV / queue state afterwards (registry,
slots, pins, every pool tensor, free KV locations and rows, waiting and running requests): unchanged
for a refused operation; for a failed request inside a batch, the other requests' outputs equal those
of the batch without it.

Covers: an unknown adapter name (refused at ``add_request``; in ``generate`` that request fails and
the batch goes on); every adapter the checkpoint reader refuses (DoRA, unmatched keys, NaN/Inf, bad
shape, rank > R, another model's dims or type, embedding / added-token / router targets), from files
and from in-memory tensors, as a first load and as a reload of a served name; a prompt longer than the
context or the KV budget; an empty prompt; token ids outside the vocabulary; max_new_tokens < 0; more
adapters in flight than slots (they wait and all finish); unload / reload of an adapter in use;
n > 1, sampling parameters out of range, unknown request fields, a duplicate request id.
"""

from __future__ import annotations

import pytest
import runner_support as rs
import torch
from safetensors.torch import load_file

from moelora_conformance.fixtures.specs import BAD_ADAPTERS
from moelora_core import assert_logprobs_close
from moelora_core.checkpoint import ADAPTER_REFUSALS
from moelora_runner import (
    AdapterInUseError,
    AdapterPinnedError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownAdapterError,
)

MODEL = "qwen3_moe"
REFUSALS = {cls.__name__: cls for cls in ADAPTER_REFUSALS}


def _refused(engine, exc_class, fragments, fn):
    before = rs.pool_snapshot(engine)
    with pytest.raises(exc_class) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    rs.assert_snapshot_equal(before, rs.pool_snapshot(engine))
    return info.value


def _request(adapter=None, n_tokens=5, **kw):
    return dict(prompt_token_ids=list(range(3, 3 + n_tokens)), adapter=adapter, max_new_tokens=3, **kw)


@pytest.fixture
def engine(make_engine):
    # A served adapter in a slot, so refusals are checked against a pool that holds something.
    e = make_engine(MODEL, max_loras=2)
    e.pin(f"{MODEL}-eng-fused-r8")
    return e


# --- unknown adapter ---------------------------------------------------------------------------------


def test_unknown_adapter_is_refused_at_add_request(engine):
    _refused(engine, UnknownAdapterError, ["'nope'", "is not loaded", f"{MODEL}-eng-fused-r8"],
             lambda: engine.add_request(_request("nope")))


def test_unknown_adapter_fails_its_request_and_the_batch_goes_on(engine, make_engine):
    good = [dict(_request(a, 4 + i), request_id=f"g{i}") for i, a in
            enumerate([None, f"{MODEL}-eng-fused-r8", f"{MODEL}-eng-legacy-r3"])]
    outputs = engine.generate([good[0], dict(_request("nope"), request_id="bad"), *good[1:]])
    bad = outputs[1]
    assert bad.request_id == "bad" and bad.finish_reason == "error" and bad.output_token_ids == []
    assert bad.error["type"] == "UnknownAdapterError" and "'nope'" in bad.error["message"]
    assert engine.metrics_.value("moelora_requests_finished_total", finish_reason="error") == 1
    alone = make_engine(MODEL, max_loras=2).generate(good)
    for got, want in zip([outputs[0], *outputs[2:]], alone):
        assert got.finish_reason == "length" and got.output_token_ids == want.output_token_ids
    assert engine.kv.free_tokens == engine.kv.num_tokens and not engine.has_unfinished()


# --- adapters the reader refuses ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", BAD_ADAPTERS, ids=lambda s: s.name)
def test_reader_refusal_reaches_the_caller_and_changes_nothing(spec, make_engine, fixture_set):
    # Each on an engine of the model it is loaded for (Qwen3-MoE; the shared-expert ones Qwen2-MoE),
    # with a served adapter pinned in a slot.
    entry = fixture_set.bad_adapter(spec.name)
    model = entry["model"]
    assert model in (MODEL, "qwen2_moe") and entry["max_rank"] == rs.POOL_RANK
    engine = make_engine(model, max_loras=2)
    engine.pin(f"{model}-eng-fused-r8")
    path = fixture_set.bad_adapter_dir(spec.name)
    probe = _request(f"{model}-eng-fused-r8")
    before = engine.generate([probe])[0]
    _refused(engine, REFUSALS[entry["refusal"]], entry["message"], lambda: engine.load_adapter(spec.name, path))
    assert spec.name not in engine.adapters
    assert engine.metrics_.value("moelora_adapter_refusals_total", error=entry["refusal"]) == 1
    # A reload of a served name with the bad files is refused the same way; the old weights still serve.
    _refused(engine, REFUSALS[entry["refusal"]], entry["message"][:1],
             lambda: engine.load_adapter(f"{model}-eng-fused-r8", path))
    after = engine.generate([probe])[0]
    assert after.output_token_ids == before.output_token_ids and after.output_logprobs == before.output_logprobs


def _tensors_of(engine_adapters, name):
    path = dict(engine_adapters[MODEL])[name]
    import json

    return load_file(str(path / "adapter_model.safetensors")), json.loads((path / "adapter_config.json").read_text())


def test_in_memory_tensors_get_the_same_refusals(engine, engine_adapters):
    tensors, config = _tensors_of(engine_adapters, f"{MODEL}-eng-rslora-r6")
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    nan = dict(tensors)
    nan[key] = tensors[key].clone()
    nan[key].view(-1)[0] = float("nan")
    _refused(engine, REFUSALS["NonFiniteWeightError"], [key, "NaN"],
             lambda: engine.load_adapter_from_tensors("rl", nan, config))
    short = dict(tensors)
    short[key] = tensors[key][:-1]
    _refused(engine, REFUSALS["ShapeMismatchError"], [key, "wrong shape"],
             lambda: engine.load_adapter_from_tensors("rl", short, config))
    dora = dict(config, use_dora=True)
    _refused(engine, REFUSALS["DoRAError"], ["use_dora"], lambda: engine.load_adapter_from_tensors("rl", tensors, dora))
    assert "rl" not in engine.adapters


# --- prompts -----------------------------------------------------------------------------------------


def test_prompt_longer_than_the_context(engine):
    ctx = engine.info.max_context
    _refused(engine, PromptTooLongError, [f"{ctx + 1} tokens", f"context of {ctx}"],
             lambda: engine.add_request(dict(prompt_token_ids=[5] * (ctx + 1))))


def test_prompt_longer_than_the_kv_budget(make_engine):
    engine = make_engine(MODEL, adapters=False, kv_cache_tokens=32)
    _refused(engine, PromptTooLongError, ["20", "16", "36 tokens", "KV cache of 32"],
             lambda: engine.add_request(dict(prompt_token_ids=[5] * 20, max_new_tokens=16)))
    # 20 + 12 fits exactly: admitted and served.
    out = engine.generate([dict(prompt_token_ids=[5] * 20, max_new_tokens=12, ignore_eos=True)])[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 12


@pytest.mark.parametrize("prompt", [dict(prompt_token_ids=[]), dict(prompt="")], ids=["ids", "text"])
def test_empty_prompt(engine, prompt):
    _refused(engine, InvalidRequestError, ["is empty"], lambda: engine.add_request(dict(prompt, max_new_tokens=2)))


@pytest.mark.parametrize("bad", [96, -1, 10**6])
def test_token_ids_outside_the_vocabulary(engine, bad):
    _refused(engine, InvalidRequestError, ["prompt_token_ids[2]", f"token id {bad}", "vocabulary [0, 96)"],
             lambda: engine.add_request(dict(request_id="v", prompt_token_ids=[5, 6, bad, 7])))
    _refused(engine, InvalidRequestError, ["stop_token_ids[0]", f"token id {bad}"],
             lambda: engine.add_request(dict(prompt_token_ids=[5], stop_token_ids=[bad])))


def test_negative_max_new_tokens(engine):
    _refused(engine, InvalidRequestError, ["'m' max_new_tokens", "-1"],
             lambda: engine.add_request(dict(request_id="m", prompt_token_ids=[5, 6], max_new_tokens=-1)))


@pytest.mark.parametrize("field,value,fragment", [
    ("n", 2, "only n = 1"), ("temperature", -0.5, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", 0, "top_k"),
    ("seed", -3, "seed"), ("logprobs", -1, "logprobs"), ("ignore_eos", "yes", "ignore_eos"),
    ("prompt_logprobs", 1, "prompt_logprobs"), ("colour", "blue", "unknown field"),
])
def test_bad_request_fields(engine, field, value, fragment):
    _refused(engine, InvalidRequestError, [fragment],
             lambda: engine.add_request({"prompt_token_ids": [5, 6], field: value}))


def test_duplicate_request_id_of_an_unfinished_request(engine):
    engine.add_request(dict(request_id="dup", prompt_token_ids=[5, 6]))
    _refused(engine, InvalidRequestError, ["'dup'", "already used"],
             lambda: engine.add_request(dict(request_id="dup", prompt_token_ids=[7])))


# --- more adapters than slots; adapters in use ------------------------------------------------------


def test_duplicate_request_ids_in_one_generate_call_are_refused_before_anything_runs(engine):
    from moelora_runner import DuplicateRequestIdError

    reqs = [dict(request_id="a", prompt_token_ids=[3, 4]), dict(prompt_token_ids=[5]),
            dict(request_id="a", prompt_token_ids=[6])]
    with pytest.raises(DuplicateRequestIdError, match=r"request 'a' request_id: is given twice \(requests 0 and 2"):
        engine.generate(reqs)
    assert not engine.has_unfinished()  # nothing was queued
    assert engine.generate(reqs[:2])[0].request_id == "a"


def test_more_adapters_than_slots_wait_and_all_finish(make_engine, engine_adapters):
    # 5 adapters + base on 2 slots (SGLang's "N adapters + base" case): they wait for slots, never crash.
    names = [n for n, _ in engine_adapters[MODEL]]
    requests = rs.mixed_requests([None, *names], 18, seed=3, prompt_len=(2, 9), max_new_tokens=4, ignore_eos=True)
    engine = make_engine(MODEL, max_loras=2, max_num_batched_tokens=64)
    rec = rs.StepRecorder(engine)
    outputs = engine.generate(requests)
    assert all(o.finish_reason == "length" for o in outputs)
    assert rec.max_distinct_adapters() <= 2 and max(len(rs.slots_used(s.batch_spec)) for s in rec.steps) <= 2
    assert engine.metrics_.value("moelora_adapter_evictions_total") >= 3
    roomy = make_engine(MODEL, max_loras=8, max_num_batched_tokens=64).generate(requests)
    for got, want in zip(outputs, roomy):
        assert got.output_token_ids == want.output_token_ids
        assert_logprobs_close(got.output_logprobs, want.output_logprobs, comparison="batched_vs_alone",
                                 dtype="float32", what=got.request_id)
    assert engine.kv.free_tokens == engine.kv.num_tokens


def test_unload_and_reload_of_an_adapter_in_use_are_refused(engine, engine_adapters):
    name = f"{MODEL}-eng-legacy-r3"
    waiting = engine.add_request(dict(_request(name), request_id="w"))
    _refused(engine, AdapterInUseError, [name, "0 running and 1 waiting"], lambda: engine.unload_adapter(name))
    engine.step()  # now running
    assert engine.scheduler.running and engine.adapters.slot_of(name) is not None
    _refused(engine, AdapterInUseError, [name, "1 running"], lambda: engine.unload_adapter(name))
    _refused(engine, AdapterInUseError, ["cannot reload", name],
             lambda: engine.load_adapter(name, dict(engine_adapters[MODEL])[name]))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [waiting] and outputs[0].finish_reason == "length"
    slot = engine.adapters.slot_of(name)
    engine.unload_adapter(name)  # free now
    assert name not in engine.adapters and engine.adapters.slots()[slot] is None
    for pool in engine.adapters.pools:
        assert pool.slot_rank(slot) == 0 and not pool.down_A[slot].any() and not pool.dense_A["o"][slot].any()


def test_unload_of_a_pinned_adapter_is_refused(engine):
    name = f"{MODEL}-eng-fused-r8"
    _refused(engine, AdapterPinnedError, [name, "unpin"], lambda: engine.unload_adapter(name))
    engine.unpin(name)
    engine.unload_adapter(name)
    assert name not in engine.adapters


def test_unknown_adapter_operations(engine):
    for op in (engine.unload_adapter, engine.pin, engine.unpin):
        _refused(engine, UnknownAdapterError, ["'ghost'"], lambda op=op: op("ghost"))


def test_text_prompt_uses_the_checkpoint_tokenizer(engine, fixture_set):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(fixture_set.model_dir(MODEL)))("Hi there!").input_ids
    out = engine.generate([dict(prompt="Hi there!", max_new_tokens=2)])[0]
    assert out.prompt_token_ids == ids and ids[0] == 0  # the tokenizer's BOS
    by_ids = engine.generate([dict(prompt_token_ids=ids, max_new_tokens=2)])[0]
    assert by_ids.output_token_ids == out.output_token_ids
    assert torch.equal(torch.tensor(by_ids.output_logprobs), torch.tensor(out.output_logprobs))


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_loras=2, max_loras_per_batch=3), "max_loras_per_batch: 3 > max_loras 2"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens: must be an int >= 1"),
    (dict(dtype="float64"), "dtype: must be 'auto' or one of"),
    (dict(moe_impl="cuda"), "moe_impl: must be one of"),
    pytest.param(dict(backend="csgmv", dtype="bfloat16"), "bfloat16 Triton kernels compute wrongly",
                 marks=pytest.mark.skipif(rs.DEVICE != "cpu", reason="a CPU refusal")),
    (dict(backend="no_such_module:factory"), "cannot import 'no_such_module'"),
])
def test_bad_engine_arguments(make_engine, kwargs, fragment):
    from moelora_core import InvalidFieldError

    with pytest.raises(InvalidFieldError) as info:
        make_engine(MODEL, adapters=False, **kwargs)
    assert fragment in str(info.value)
