"""Sampling: greedy, temperature / top-k / top-p from one generator per request, and the logprobs
reported.

Covers: ``sample_token`` keeps draws inside top-k and inside the top-p nucleus (crafted logits), and
is a pure function of the logits and the generator state; in the engine, a seeded request gives the
same tokens alone, again, and among batch mates arriving in another order, another seed other tokens;
top-k 1 and a tiny top-p equal greedy; top-N logprobs are sorted, N long, and the greedy token is the
top one with the reported logprob.
"""

from __future__ import annotations

import torch

from moelora_runner import EngineRequest
from moelora_runner.sampler import sample_token, top_logprobs

MODEL = "olmoe"


def test_top_k_and_top_p_bound_the_draws():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, -1.0, -3.0])
    gen = torch.Generator().manual_seed(0)
    k2 = EngineRequest(prompt_token_ids=(1,), temperature=2.0, top_k=2)
    assert {sample_token(logits, k2, gen) for _ in range(200)} == {0, 1}
    probs = torch.softmax(logits, -1)  # 0.43, 0.26, 0.16, ...: the 0.6 nucleus is {0, 1}
    p = EngineRequest(prompt_token_ids=(1,), temperature=1.0, top_p=float(probs[0] + probs[1] / 2))
    assert {sample_token(logits, p, gen) for _ in range(200)} == {0, 1}
    tiny = EngineRequest(prompt_token_ids=(1,), temperature=1.0, top_p=1e-6)
    assert {sample_token(logits, tiny, gen) for _ in range(20)} == {0}
    everything = EngineRequest(prompt_token_ids=(1,), temperature=5.0)
    assert len({sample_token(logits, everything, gen) for _ in range(400)}) == 6


def test_a_draw_depends_on_the_logits_and_the_generator_only():
    logits = torch.randn(96)
    req = EngineRequest(prompt_token_ids=(1,), temperature=0.9, top_k=50, top_p=0.9)
    a = [sample_token(logits, req, g) for g in [torch.Generator().manual_seed(5)] for _ in range(30)]
    torch.rand(100)  # the global generator is not involved
    b = [sample_token(logits, req, g) for g in [torch.Generator().manual_seed(5)] for _ in range(30)]
    assert a == b and len(set(a)) > 1


def _sampled(rid, seed, **kw):
    return dict(request_id=rid, prompt_token_ids=[9, 21, 33, 4, 58], max_new_tokens=8, temperature=1.0, seed=seed,
                ignore_eos=True, **kw)


def test_seeded_requests_ignore_their_batch_mates(make_engine, engine_adapters):
    name = engine_adapters[MODEL][1][0]
    engine = make_engine(MODEL, max_num_batched_tokens=16)
    alone = engine.generate([_sampled("s", 11, adapter=name)])[0]
    again = engine.generate([_sampled("s", 11, adapter=name)])[0]
    mates = [dict(request_id=f"m{i}", prompt_token_ids=list(range(3, 12 + i)), max_new_tokens=5, temperature=0.7,
                  seed=i, adapter=[None, name][i % 2]) for i in range(5)]
    mixed = engine.generate([*mates[:3], _sampled("s", 11, adapter=name), *mates[3:]])[3]
    other = engine.generate([_sampled("s", 12, adapter=name)])[0]
    assert alone.output_token_ids == again.output_token_ids == mixed.output_token_ids
    assert other.output_token_ids != alone.output_token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(make_engine):
    engine = make_engine(MODEL, adapters=False)
    greedy = engine.generate([dict(_sampled("g", 0), temperature=0.0)])[0].output_token_ids
    assert engine.generate([_sampled("k", 3, top_k=1)])[0].output_token_ids == greedy
    assert engine.generate([_sampled("p", 4, top_p=1e-6)])[0].output_token_ids == greedy


def test_top_logprobs(make_engine):
    engine = make_engine(MODEL, adapters=False)
    out = engine.generate([dict(_sampled("t", 0), temperature=0.0, logprobs=3)])[0]
    assert len(out.top_logprobs) == len(out.output_token_ids) == 8
    for token, logprob, top in zip(out.output_token_ids, out.output_logprobs, out.top_logprobs):
        values = [t["logprob"] for t in top]
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert top[0]["token_id"] == token and top[0]["logprob"] == logprob
    assert top_logprobs(torch.log_softmax(torch.tensor([0.0, 1.0]), -1), 5)[0]["token_id"] == 1
    assert engine.generate([dict(_sampled("n", 0), temperature=0.0)])[0].top_logprobs is None
