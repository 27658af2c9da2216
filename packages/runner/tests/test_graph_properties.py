"""Graph runners under random workloads (Hypothesis; examples per the moelora profile: ``interpret``
in CI), on the reference backend — the kernel backends run the fixed cases of
``test_graph_equivalence.py`` / ``test_graph_state.py``. The ``interpret`` profile (CI) draws on one
family (Qwen3-MoE); ``dev`` / ``soak`` draw every fixture family.

- ``test_graph_engine_equals_eager_engine``: a random mix (base and five adapter formats, prompt
  lengths, ``max_new_tokens`` including 0, arrival steps with idle steps between), random token
  budgets, slot counts, per-batch caps, prefill modes, decode graph on or off, random bucket lists
  and request slots (so steps land in padded buckets, reuse buckets after larger and smaller batches,
  and fall back past them) → every request equals the same workload on an eager engine of the same
  configuration (``graph_vs_eager`` row; greedy tokens up to the first near-tie), and every pass ran
  where the configuration says: on its family's graph with ``reason=""`` when it fits a bucket, else
  eagerly with the reason.
"""

from __future__ import annotations

import graph_support as gs
import pytest
import runner_support as rs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelora_conformance.profiles import current_profile

#: Fixture models drawn: one family in the CI-sized ``interpret`` profile, every family beyond it.
INTERPRET_MODELS = ("qwen3_moe",)

pytestmark = [pytest.mark.cudagraph, pytest.mark.xdist_group("graphs-reference")]


def _models() -> tuple[str, ...]:
    from moelora_conformance.fixtures.specs import MODELS

    return INTERPRET_MODELS if current_profile().name == "interpret" else tuple(m.name for m in MODELS)


def _examples() -> int:
    profile = current_profile()
    return min(profile.max_examples, 10) if profile.name == "interpret" else profile.max_examples


@st.composite
def graph_workloads(draw):
    model = draw(st.sampled_from(_models()), label="model")
    n = draw(st.integers(1, 7), label="requests")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(n):
        length = draw(st.integers(1, 14), label=f"prompt_len[{i}]")
        requests.append(dict(request_id=f"q{i}", prompt_token_ids=torch.randint(2, 96, (length,), generator=gen).tolist(),
                             adapter=draw(st.sampled_from([None, 0, 1, 2, 3, 4]), label=f"adapter[{i}]"),
                             max_new_tokens=draw(st.integers(0, 4), label=f"max_new[{i}]"), ignore_eos=True,
                             prompt_logprobs=True, logprobs=2))
    arrivals = [draw(st.integers(0, 3), label=f"arrival[{i}]") for i in range(n)]
    max_loras = draw(st.integers(1, 4), label="max_loras")
    budget = draw(st.integers(1, 40), label="budget")
    graphs = dict(graph=draw(st.sampled_from(["eager", "full", "breakable"]), label="graph"),
                  decode_graph=draw(st.booleans(), label="decode_graph"),
                  prefill_token_buckets=draw(st.lists(st.sampled_from([4, 8, 12, 24, 40]), min_size=1, max_size=3,
                                                      unique=True), label="prefill_buckets"),
                  decode_batch_buckets=draw(st.lists(st.integers(1, 8), min_size=1, max_size=3, unique=True),
                                            label="decode_buckets"),
                  max_num_requests=draw(st.integers(1, 8), label="max_num_requests"))
    config = dict(max_num_batched_tokens=budget, max_loras=max_loras,
                  max_loras_per_batch=draw(st.integers(1, max_loras), label="per_batch"), kv_cache_tokens=128)
    return model, requests, arrivals, config, graphs


@settings(max_examples=_examples(), deadline=None)
@given(workload=graph_workloads())
def test_graph_engine_equals_eager_engine(workload, make_engine, engine_adapters):
    model, requests, arrivals, config, graphs = workload
    names = [n for n, _ in engine_adapters[model]]
    requests = [dict(r, adapter=None if r["adapter"] is None else names[r["adapter"]]) for r in requests]
    engine = make_engine(model, dtype=gs.DTYPE, graph_capture="lazy", **config, **graphs)
    got = rs.run_with_arrivals(engine, requests, arrivals)
    want = rs.run_with_arrivals(make_engine(model, dtype=gs.DTYPE, **config, **gs.MODES["eager"]), requests,
                                  arrivals)
    gs.compare_outputs(got, want, what=f"{model} graphs {graphs} {config}", record=dict(model=model))
    prefill_modes = {"eager": {"eager"}}.get(graphs["graph"], {graphs["graph"], "eager"})
    decode_modes = {"decode_graph", "eager"} if graphs["decode_graph"] else {"eager"}
    for (phase, mode, reason), _ in gs.passes(engine).items():
        if phase == "idle":
            continue
        allowed = prefill_modes if phase == "prefill" else decode_modes
        assert mode in allowed, (phase, mode, reason)
        graph_on = len(allowed) == 2
        assert (reason == "") == (mode != "eager"), (phase, mode, reason)
        assert reason != "disabled" or not graph_on, (phase, mode, reason)
