"""The scheduler inside the engine: chunked prefill under the token budget, prefill chunks and decodes
in one batch, the per-batch adapter cap (base never counts), strict first-come-first-served admission,
KV admission, idle steps, the context limit and max_new_tokens = 0.

The first test pins one schedule exactly (budget 8; prompts 20, 3, 3), so any change to what runs
when shows as a diff of (prefix_len, extend_len) per step.
"""

from __future__ import annotations

import dataclasses

import runner_support as rs
import torch

from moelora_core import ForwardMode, assert_logprobs_close

MODEL = "mixtral"


def _req(rid, n, max_new, adapter=None, **kw):
    return dict(request_id=rid, prompt_token_ids=[(5 * i + len(rid)) % 90 + 3 for i in range(n)], adapter=adapter,
                max_new_tokens=max_new, ignore_eos=True, **kw)


def test_chunked_prefill_mixes_with_decodes_on_a_fixed_schedule(make_engine):
    engine = make_engine(MODEL, adapters=False, max_num_batched_tokens=8)
    rec = rs.StepRecorder(engine)
    outputs = engine.generate([_req("A", 20, 2), _req("B", 3, 3), _req("C", 3, 3)])
    got = [(s.batch_spec.forward_mode, [(rid, r.prefix_len, r.extend_len) for rid, r in
                                        zip(s.request_ids, s.batch_spec.requests)]) for s in rec.steps]
    E, D = ForwardMode.EXTEND, ForwardMode.DECODE
    assert got == [
        (E, [("A", 0, 8)]),
        (E, [("A", 8, 8)]),
        (E, [("A", 16, 4), ("B", 0, 3), ("C", 0, 1)]),   # A's last chunk, B whole, C's first token
        (E, [("A", 20, 1), ("B", 3, 1), ("C", 1, 2)]),   # two decodes and a prefill chunk in one batch
        (D, [("B", 4, 1), ("C", 3, 1)]),
        (D, [("C", 4, 1)]),
    ]
    assert [len(o.output_token_ids) for o in outputs] == [2, 3, 3]
    passes = {p: engine.metrics_.value("moelora_forward_passes_total", phase=p, mode="eager", reason="disabled")
              for p in ("prefill", "decode")}
    assert passes == {"prefill": 4, "decode": 2}
    m = engine.metrics_
    assert m.value("moelora_tokens_total", kind="prompt") == 26 and m.value("moelora_tokens_total", kind="output") == 8


def test_adapter_cap_per_batch_never_counts_base_requests(make_engine, engine_adapters):
    names = [n for n, _ in engine_adapters[MODEL]][:3]
    engine = make_engine(MODEL, max_loras=4, max_loras_per_batch=2, max_num_batched_tokens=64)
    rec = rs.StepRecorder(engine)
    requests = [_req(f"r{i}", 3 + i % 4, 3, adapter=[None, *names][i % 4]) for i in range(12)]
    outputs = engine.generate(requests)
    assert all(o.finish_reason == "length" for o in outputs)
    assert rec.max_distinct_adapters() == 2
    assert any(len(s.adapters) == 2 and any(r.slot == -1 for r in s.batch_spec.requests) for s in rec.steps)


def test_admission_is_first_come_first_served(make_engine):
    # A KV budget of 30 tokens: the 24-token request waits for room, and no later request overtakes it.
    engine = make_engine(MODEL, adapters=False, kv_cache_tokens=30, max_num_batched_tokens=64)
    rec = rs.StepRecorder(engine)
    requests = [_req("a", 10, 4), _req("big", 20, 4), _req("c", 2, 2), _req("d", 2, 2)]
    engine.generate(requests)
    first_step = {}
    for i, s in enumerate(rec.steps):
        for rid in s.request_ids:
            first_step.setdefault(rid, i)
    assert first_step["a"] < first_step["big"] <= first_step["c"] <= first_step["d"]
    assert max(len(s.request_ids) for s in rec.steps if "big" in s.request_ids) <= 2  # 24 + 4 + 4 > 30


def test_a_request_runs_only_when_its_kv_fits(make_engine):
    engine = make_engine(MODEL, adapters=False, kv_cache_tokens=20, max_num_batched_tokens=64)
    rec = rs.StepRecorder(engine)
    requests = [_req("x", 8, 4), _req("y", 9, 3)]  # 12 + 12 > 20: one at a time
    outputs = engine.generate(requests)
    assert all(len(s.request_ids) == 1 for s in rec.steps)
    assert engine.kv.free_tokens == 20
    for req, out in zip(requests, outputs):
        alone = make_engine(MODEL, adapters=False).generate([req])[0]
        assert out.output_token_ids == alone.output_token_ids


def test_idle_step_launches_nothing(make_engine, monkeypatch):
    engine = make_engine(MODEL)
    calls = []
    monkeypatch.setattr(engine.backend, "prepare", lambda *a, **k: calls.append("prepare"))
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: calls.append("forward"))
    assert engine.step() == [] and engine.step() == []
    assert calls == []
    assert engine.metrics_.value("moelora_forward_passes_total", phase="idle", mode="eager", reason="disabled") == 2


def test_idle_steps_between_batches_change_nothing(make_engine, engine_adapters):
    name = engine_adapters[MODEL][0][0]
    first, second = _req("1", 9, 4, adapter=name, prompt_logprobs=True), _req("2", 3, 4, prompt_logprobs=True)
    engine = make_engine(MODEL)
    engine.generate([first])
    for _ in range(3):
        assert engine.step() == []
    got = engine.generate([second])[0]
    want = make_engine(MODEL).generate([second])[0]
    assert got.output_token_ids == want.output_token_ids
    assert torch.equal(torch.tensor(got.prompt_logprobs[1:] + got.output_logprobs),
                       torch.tensor(want.prompt_logprobs[1:] + want.output_logprobs))


def test_max_new_tokens_zero_returns_prompt_logprobs_only(make_engine):
    engine = make_engine(MODEL, adapters=False, max_num_batched_tokens=4)
    out = engine.generate([_req("p", 10, 0, prompt_logprobs=True)])[0]
    assert out.finish_reason == "length" and out.output_token_ids == []
    assert out.prompt_logprobs[0] is None and all(isinstance(v, float) and v <= 0 for v in out.prompt_logprobs[1:])
    full = engine.generate([_req("q", 10, 3, prompt_logprobs=True)])[0]
    assert_logprobs_close(out.prompt_logprobs[1:], full.prompt_logprobs[1:], comparison="batched_vs_alone",
                             dtype="float32", what="prompt logprobs")


def test_generation_stops_at_the_context(make_engine):
    engine = make_engine(MODEL, adapters=False, max_num_batched_tokens=512, kv_cache_tokens=512)
    ctx = engine.info.max_context
    out = engine.generate([_req("c", ctx - 2, 5)])[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 2


def test_stop_tokens_and_eos(make_engine):
    engine = make_engine(MODEL, adapters=False)
    base = engine.generate([_req("s", 6, 6)])[0].output_token_ids
    stop = engine.generate([dict(_req("t", 6, 6), stop_token_ids=[base[2]])])[0]
    assert stop.finish_reason == "stop" and stop.output_token_ids == base[: base.index(base[2]) + 1]
    engine.info = dataclasses.replace(engine.info, eos_token_ids=(base[1],))
    eos = engine.generate([dict(_req("e", 6, 6), ignore_eos=False)])[0]
    assert eos.finish_reason == "stop" and eos.output_token_ids == base[: base.index(base[1]) + 1]
    ignored = engine.generate([_req("i", 6, 6)])[0]
    assert ignored.finish_reason == "length" and ignored.output_token_ids == base
