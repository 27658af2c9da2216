"""Properties of the engine (Hypothesis; examples per the moelora profile: ``interpret`` in CI).

- ``test_every_request_equals_itself_run_alone``: random request mixes (adapters of five formats and
  base, prompt lengths, max_new_tokens including 0, greedy and seeded sampling with top-k / top-p,
  eos on or off), random arrival steps (requests join a running engine, idle steps included), random
  token budgets, KV budgets, slot counts and per-batch adapter caps → every request's tokens, finish
  reason, prompt logprobs and output logprobs equal that request run alone on a fresh engine
  (logprobs within the ``batched_vs_alone`` row; greedy tokens up to the first near-tie of the alone
  run's top-2 margin, where a flip is within tolerance).
- ``test_base_requests_are_bitwise_identical_with_and_without_lora``: the same random mix run twice —
  with its adapters, and with every request on the base model — gives base requests bitwise the same
  tokens and logprobs (DESIGN.md §1: a token with no adapter gets exactly the base output). Both runs
  use the same schedule (checked), so the base rows go through the same kernels on the same shapes.

The ``interpret`` profile (CI) draws on one family (Qwen3-MoE) and runs 10 examples per property;
``dev`` / ``soak`` draw every fixture family with the profile's example count.
Values (token ids) come from a ``torch.Generator`` seeded by a drawn seed; Hypothesis draws structure.
"""

from __future__ import annotations

import runner_support as rs
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moelora_conformance.profiles import current_profile
from moelora_core import LogprobCheck, logprob_tolerance

#: Fixture models drawn: one family in the CI-sized ``interpret`` profile, every family beyond it.
INTERPRET_MODELS = ("qwen3_moe",)
TOL = logprob_tolerance("batched_vs_alone", "float32").max_abs


def _examples() -> int:
    profile = current_profile()
    return min(profile.max_examples, 10) if profile.name == "interpret" else profile.max_examples


def _models() -> tuple[str, ...]:
    from moelora_conformance.fixtures.specs import MODELS

    return INTERPRET_MODELS if current_profile().name == "interpret" else tuple(m.name for m in MODELS)


def _request(i: int, prompt: list[int], *, adapter: int | None, max_new_tokens: int = 0, temperature: float = 0.0,
             top_k: int = -1, top_p: float = 1.0, ignore_eos: bool = False) -> dict:
    """Request ``q<i>`` (``adapter`` indexes the model's engine adapters; None = base)."""
    return dict(request_id=f"q{i}", prompt_token_ids=prompt, adapter=adapter, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=i, ignore_eos=ignore_eos,
                prompt_logprobs=True, logprobs=2)


@st.composite
def workloads(draw, max_requests: int = 6):
    model = draw(st.sampled_from(_models()), label="model")
    n = draw(st.integers(1, max_requests), label="requests")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(n):
        length = draw(st.integers(1, 20), label=f"prompt_len[{i}]")
        sampled = draw(st.booleans(), label=f"sampled[{i}]")
        requests.append(_request(
            i, torch.randint(2, 96, (length,), generator=gen).tolist(),
            adapter=draw(st.sampled_from([None, 0, 1, 2, 3, 4]), label=f"adapter[{i}]"),
            max_new_tokens=draw(st.integers(0, 6), label=f"max_new[{i}]"),
            temperature=0.8 if sampled else 0.0,
            top_k=draw(st.sampled_from([-1, 5]), label=f"top_k[{i}]") if sampled else -1,
            top_p=draw(st.sampled_from([1.0, 0.9]), label=f"top_p[{i}]") if sampled else 1.0,
            ignore_eos=draw(st.booleans(), label=f"ignore_eos[{i}]"),
        ))
    arrivals = [draw(st.integers(0, 4), label=f"arrival[{i}]") for i in range(n)]
    max_loras = draw(st.integers(1, 4), label="max_loras")
    config = dict(max_num_batched_tokens=draw(st.integers(1, 48), label="budget"), max_loras=max_loras,
                  max_loras_per_batch=draw(st.integers(1, max_loras), label="per_batch"),
                  kv_cache_tokens=draw(st.integers(26, 120), label="kv_tokens"))
    return model, requests, arrivals, config


#: Found by the dev profile (2026-12): a 2-token prompt has one logprob, whose 1.1e-5 batched-vs-alone
#: difference failed a per-request mean bound (the mean of one value is its max): means are now held
#: over a whole comparison of >= MEAN_MIN_SAMPLES logprobs (moelora_core.tolerance.LogprobCheck).
H2I_SHORT_PROMPT = ("qwen3_moe_h2i", [
    _request(0, [30, 5, 24, 84, 78, 40, 19, 29, 92, 54, 50, 77, 52, 31, 61, 40, 11], adapter=None, temperature=0.0),
    _request(1, [74, 29, 40, 85, 41, 23, 56, 16, 40, 93, 22, 94, 89, 18, 19, 92, 11], adapter=None, temperature=0.0),
    _request(2, [28, 66, 7, 95, 16, 14, 79, 4, 31, 38, 73, 56, 56, 73, 69, 8, 28, 22, 80, 67], adapter=None, temperature=0.0),
    _request(3, [40, 5, 14, 24, 32, 33, 78, 45, 23, 54, 58, 92, 28, 89, 85, 13, 67, 89], adapter=None, temperature=0.0),
    _request(4, [4, 49, 20, 54, 89, 47, 22, 79, 56, 80, 25, 4, 35, 9, 6, 61, 27, 81, 94, 48], adapter=None, temperature=0.0),
    _request(5, [57, 84], adapter=4, temperature=0.8),
], [0, 0, 0, 0, 0, 0], {'max_num_batched_tokens': 3, 'max_loras': 1, 'max_loras_per_batch': 1, 'kv_cache_tokens': 26})


def _named(requests, names):
    return [dict(r, adapter=None if r["adapter"] is None else names[r["adapter"]]) for r in requests]


_ALONE: dict = {}


def _alone(make_engine, model, request):
    key = (model, repr(sorted(request.items())))
    if key not in _ALONE:
        engine = make_engine(model, max_loras=1, max_num_batched_tokens=64, check_host_sync=False)
        _ALONE[key] = engine.generate([request])[0]
    return _ALONE[key]


def _margins(out):
    return [t[0]["logprob"] - t[1]["logprob"] for t in out.top_logprobs]


@settings(max_examples=_examples())
@given(workload=workloads())
@example(workload=H2I_SHORT_PROMPT)
def test_every_request_equals_itself_run_alone(workload, make_engine, engine_adapters):
    model, requests, arrivals, config = workload
    names = [n for n, _ in engine_adapters[model]]
    requests = _named(requests, names)
    engine = make_engine(model, **config)
    outputs = rs.run_with_arrivals(engine, requests, arrivals)
    assert engine.kv.free_tokens == engine.kv.num_tokens and not engine.scheduler.running
    check = LogprobCheck("batched_vs_alone", "float32")
    for req, got in zip(requests, outputs):
        want = _alone(make_engine, model, req)
        what = f"{req['request_id']} ({req['adapter'] or 'base'}, {config})"
        assert got.finish_reason in ("stop", "length"), (what, got.error)
        check.add(got.prompt_logprobs[1:], want.prompt_logprobs[1:], what=f"{what} prompt logprobs")
        # Tokens agree up to the first step where the alone run had a near-tie (greedy) — sampled
        # requests draw from their own generator, so they must agree everywhere.
        agree = len(want.output_token_ids)
        if req["temperature"] == 0.0:
            agree = next((j for j, m in enumerate(_margins(want)) if m <= 2 * TOL), agree)
        assert got.output_token_ids[:agree] == want.output_token_ids[:agree], what
        check.add(got.output_logprobs[:agree], want.output_logprobs[:agree], what=f"{what} output logprobs")
        if agree == len(want.output_token_ids):
            assert got.output_token_ids == want.output_token_ids and got.finish_reason == want.finish_reason, what
    check.finish(f"batched vs alone ({config})")


@settings(max_examples=_examples())
@given(workload=workloads(max_requests=8))
def test_base_requests_are_bitwise_identical_with_and_without_lora(workload, make_engine, engine_adapters):
    model, requests, arrivals, config = workload
    names = [n for n, _ in engine_adapters[model]]
    # Same lengths in both runs (no eos), enough slots and cap for every adapter: the schedule cannot
    # depend on the adapters, so both runs feed the base rows through the same shapes.
    requests = [dict(r, ignore_eos=True) for r in _named(requests, names)]
    config = dict(config, max_loras=5, max_loras_per_batch=5)
    with_lora, without = make_engine(model, **config), make_engine(model, **config)
    rec_with, rec_without = rs.StepRecorder(with_lora), rs.StepRecorder(without)
    got = rs.run_with_arrivals(with_lora, requests, arrivals)
    base = rs.run_with_arrivals(without, [dict(r, adapter=None) for r in requests], arrivals)
    shapes = [[(r.prefix_len, r.extend_len) for r in s.batch_spec.requests] for s in rec_with.steps]
    assert shapes == [[(r.prefix_len, r.extend_len) for r in s.batch_spec.requests] for s in rec_without.steps]
    for req, a, b in zip(requests, got, base):
        if req["adapter"] is None:
            assert a.output_token_ids == b.output_token_ids, req["request_id"]
            assert torch.equal(torch.tensor(a.prompt_logprobs[1:] + a.output_logprobs),
                               torch.tensor(b.prompt_logprobs[1:] + b.output_logprobs)), req["request_id"]
