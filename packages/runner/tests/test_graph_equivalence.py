"""Graph replay equals eager, per backend × mode (DESIGN.md §6), on the CPU emulator (real CUDA graphs
with ``MOELORA_RUNNER_DEVICE=cuda``).

- ``test_graph_replay_equals_eager``: a mixed workload (base and three adapters over two slots, so
  adapters are evicted and loaded into slots after their buckets were captured; chunked prefill under
  a 12-token budget, so prefill chunks and decodes share batches; decodes of 3 and 1 requests padded
  into a 4-request bucket) served on the prefill graph
  (``full`` / ``breakable``) and the decode graph gives every request the tokens and logprobs of the
  same workload served eagerly (``graph_vs_eager`` row; greedy tokens up to the first near-tie), and
  the metrics prove every prefill and decode pass ran on a graph (mixed batches on the prefill graph,
  counted ``phase="prefill"``).
- ``test_triton_base_moe_path_under_graphs``: the same comparison with the Triton base MoE
  (``moe_impl="triton"``, CUDA's default; the other cases use the torch base path on the CPU) on the
  triton backend: its alignment and GEMM launches captured and replayed.
- ``test_more_than_32_requests_in_one_prefill_replay``: 45 requests, interleaved over five adapters
  and base (45 adapter runs along the batch, more segments than a cap of 32 would allow), in one
  prefill replay of a 64-token bucket with the default 64 request slots: one graph pass, outputs
  equal eager.
"""

from __future__ import annotations

import graph_support as gs
import pytest
import runner_support as rs

from moelora_conformance.profiles import current_profile

MODEL = "qwen3_moe"
#: One xdist group per backend: its eager runs are made once and shared by its modes.
BACKENDS = [pytest.param("reference", marks=pytest.mark.xdist_group("graphs-reference")),
            pytest.param("triton", marks=[pytest.mark.interpreter, pytest.mark.xdist_group("graphs-triton")]),
            pytest.param("csgmv", marks=[pytest.mark.interpreter, pytest.mark.xdist_group("graphs-csgmv")])]
#: Two slots for three adapters (evictions after capture); a 12-token budget (chunked prefill); one
#: decode bucket of 4 (every decode step padded).
MIXED = dict(max_loras=2, max_num_batched_tokens=12, kv_cache_tokens=256)
GRAPHS = dict(decode_batch_buckets=(4,))
#: CI-sized: the >32-request and Triton-base-MoE cases on one mode per kernel backend (every mode beyond
#: the interpret profile and on the GPU).
CI_CROSS = {("triton", "breakable"), ("csgmv", "full"), ("triton-moe", "breakable")}


#: (backend, mode) whose graph == eager claim the main job's E01 holds on the CPU (noxfile.py MAIN_CHECKS:
#: e2e-reference in every graph mode, e2e-triton in full, e2e-csgmv in breakable, each with evictions,
#: chunked prefills and mixed steps in its workload): in the interpret profile only the other two run here.
IN_MAIN_JOB = {("reference", "full"), ("reference", "breakable"), ("triton", "full"), ("csgmv", "breakable")}


def _ci_sized(backend: str, mode: str, cases=CI_CROSS, why: str = "this case runs in its other mode here") -> None:
    if (backend, mode) in cases and rs.DEVICE == "cpu" and current_profile().name == "interpret":
        pytest.skip(f"CI-sized: {why}")

pytestmark = pytest.mark.cudagraph

_EAGER: dict = {}


def _eager(make_engine, key, backend, requests, **config):
    if key not in _EAGER:
        engine = make_engine(MODEL, backend=backend, dtype=gs.DTYPE, **config, **gs.MODES["eager"])
        _EAGER[key] = engine.generate(requests)
    return _EAGER[key]


def _names(engine_adapters):
    return [n for n, _ in engine_adapters[MODEL]]


@pytest.mark.parametrize("mode", ["full", "breakable"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_replay_equals_eager(backend, mode, make_engine, engine_adapters):
    _ci_sized(backend, mode, IN_MAIN_JOB, "the main job's E01 holds this claim")
    names = _names(engine_adapters)
    requests = rs.mixed_requests([None, *names[:3]], 6, seed=15, prompt_len=(1, 10), max_new_tokens=3,
                                 ignore_eos=True, logprobs=2)
    want = _eager(make_engine, ("mixed", backend), backend, requests, **MIXED)
    engine = make_engine(MODEL, backend=backend, dtype=gs.DTYPE, **MIXED, **GRAPHS, **gs.MODES[mode])
    recorder = rs.StepRecorder(engine)
    got = engine.generate(requests)
    gs.assert_ran_on_graphs(engine, mode)
    assert recorder.mixed_steps() > 0, "no batch mixed a prefill chunk with decodes"
    assert engine.metrics_.value("moelora_adapter_evictions_total") > 0
    gs.compare_outputs(got, want, what=f"{backend} {mode} vs eager", record=dict(backend=backend, mode=mode))


@pytest.mark.interpreter
@pytest.mark.xdist_group("graphs-triton-moe")
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_triton_base_moe_path_under_graphs(mode, make_engine, engine_adapters):
    _ci_sized("triton-moe", mode)
    names = _names(engine_adapters)
    requests = rs.mixed_requests([None, *names[:3]], 4, seed=3, prompt_len=(1, 6), max_new_tokens=2,
                                 ignore_eos=True, logprobs=2)
    config = dict(MIXED, moe_impl="triton", max_num_batched_tokens=16)
    want = _eager(make_engine, ("triton-moe",), "triton", requests, **config)
    engine = make_engine(MODEL, backend="triton", dtype=gs.DTYPE, **config, **GRAPHS, **gs.MODES[mode])
    got = engine.generate(requests)
    assert engine.moe_impl == "triton"
    gs.assert_ran_on_graphs(engine, mode)
    gs.compare_outputs(got, want, what=f"triton moe_impl=triton {mode} vs eager",
                       record=dict(backend="triton", moe_impl="triton", mode=mode))


@pytest.mark.parametrize("mode", ["full", "breakable"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_more_than_32_requests_in_one_prefill_replay(backend, mode, make_engine, engine_adapters):
    _ci_sized(backend, mode)
    names = _names(engine_adapters)
    requests = rs.mixed_requests([None, *names], 45, seed=32, prompt_len=(1, 2), max_new_tokens=1,
                                 ignore_eos=True, logprobs=2)
    # One 64-token bucket with 64 request slots (the default): the 62 prompt tokens in one replay.
    config = dict(max_loras=5, max_num_batched_tokens=64, kv_cache_tokens=256, prefill_token_buckets=(64,))
    want = _eager(make_engine, ("many", backend), backend, requests, **config)
    engine = make_engine(MODEL, backend=backend, dtype=gs.DTYPE, **config, **gs.MODES[mode])
    recorder = rs.StepRecorder(engine)
    got = engine.generate(requests)
    assert len(recorder.steps) == 1, "all 45 prompts in one step"
    spec = recorder.steps[0].batch_spec
    runs = 1 + sum(a.slot != b.slot for a, b in zip(spec.requests, spec.requests[1:]))
    assert spec.bs == 45 and runs > 32, (spec.bs, runs)
    assert gs.passes(engine) == {("prefill", mode, ""): 1}
    assert engine.graphs.max_num_requests == 64 and engine.runner.prefill_graph.buckets[64].requests == 64
    gs.compare_outputs(got, want, what=f"{backend} {mode} 45 requests vs eager",
                       record=dict(backend=backend, mode=mode, requests=45))
