"""The components an engine is built with: ``Engine(parts=EngineParts(...))`` (DESIGN.md §6, "The
engine"; the suite's engine-level faulty variants are composed so).

Covers: an engine built with subclasses of the adapter pool and the model runner serves through them —
every admitted adapter request is acquired through the pool subclass's public ``acquire``, every step's
plan comes from the runner subclass's ``plan`` and is the one its ``forward`` runs — and subclasses that
change nothing give the outputs of an engine built with the defaults, token for token and logprob for
logprob (the parts are called with what the engine passes the classes).
"""

from __future__ import annotations

import random

import runner_support as rs

from moelora_runner import EngineParts
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.model_runner import ModelRunner

MODEL = "qwen3_moe"


def test_an_engine_serves_through_the_parts_it_is_built_with(make_engine, engine_adapters):
    acquired, planned, ran = [], [], []

    class CountingPool(AdapterPool):
        def acquire(self, name):
            acquired.append(name)
            return super().acquire(name)

    class RecordingRunner(ModelRunner):
        def plan(self, batch):
            planned.append(super().plan(batch))
            return planned[-1]

        def forward(self, plan):
            ran.append(plan)
            return super().forward(plan)

    seed = random.randrange(2**31)
    names = [name for name, _ in engine_adapters[MODEL]]
    requests = rs.mixed_requests(
        [names[0], None, names[1], names[0]], 5, seed=seed, prompt_len=(1, 12), max_new_tokens=3
    )
    # 2 slots for 2 adapters and a budget that chunks prompts: prefill chunks and decodes mix in steps
    sizes = dict(max_loras=2, max_num_batched_tokens=8, kv_cache_tokens=256)
    composed = make_engine(MODEL, parts=EngineParts(adapter_pool=CountingPool, model_runner=RecordingRunner), **sizes)
    default = make_engine(MODEL, **sizes)
    assert type(composed.adapters) is CountingPool and type(composed.runner) is RecordingRunner
    assert type(default.adapters) is AdapterPool and type(default.runner) is ModelRunner
    got, want = composed.generate(requests), default.generate(requests)

    assert sorted(acquired) == sorted(r["adapter"] for r in requests if r["adapter"] is not None), (seed, acquired)
    assert planned and len(planned) == len(ran) and all(p is r for p, r in zip(planned, ran)), seed
    for g, w in zip(got, want, strict=True):
        assert _served(g) == _served(w), (seed, g, w)


def _served(out) -> tuple:
    return out.request_id, out.output_token_ids, out.finish_reason, out.output_logprobs, out.prompt_logprobs
