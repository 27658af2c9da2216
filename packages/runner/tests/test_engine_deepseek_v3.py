"""The engine on DeepSeek-V3 against HF transformers + PEFT (DESIGN.md §1; ``moelora_runner.mla``).

The fixture ``deepseek_v3`` (sigmoid group-limited routing with a nonzero correction bias and
routed_scaling_factor 2.5, one dense first layer, two ungated shared experts, MLA with q_lora_rank,
YaRN and interleaved RoPE) with its peft adapters (routed experts + MLA projections; rsLoRA with a
rank pattern) and the builder's shared-expert / dense-MLP adapter (peft cannot load it: its reference
is the per-module one, the deltas merged into transformers' weights). Covers: a mixed batch's prompt
and output logprobs equal HF + PEFT (fp32, CPU) eagerly and on the decode, ``full`` and ``breakable``
graphs with the reference backend, and on the triton and csgmv backends (interpreter); LoRA on every
MLA projection, the shared experts and the dense MLP reaches ``Backend.dense_delta`` in the layer's
order; each routing fault of the family (the correction bias in the weights too, group limiting
skipped, routed_scaling_factor twice or on the shared experts) fails the comparison.
"""

from __future__ import annotations

import graph_support as gs
import pytest
import runner_support as rs

from moelora_conformance.faulty.routing_faults import ROUTING_FAULTS, make_engine_faulty
from moelora_conformance.fixtures.specs import DEEPSEEK_V3, DEEPSEEK_V3_ADAPTERS

MODEL = DEEPSEEK_V3.name
LAYOUT = "deepseek_v3-shared-dense"


@pytest.fixture(scope="module")
def deepseek(fixture_set):
    from moelora_conformance.hf_check.hf_model import load_hf
    from moelora_conformance.hf_check.per_module import merged_reference_model

    adapters = {s.name: fixture_set.adapter_dir(s.name) for s in DEEPSEEK_V3_ADAPTERS}
    adapters[LAYOUT] = fixture_set.layout_adapter_dir(LAYOUT)
    model_dir = fixture_set.model_dir(MODEL)
    hf = rs.HFReference(model_dir, adapters)
    hf._models[LAYOUT] = merged_reference_model(load_hf(model_dir), adapters[LAYOUT])  # peft cannot load it
    return model_dir, adapters, hf


def _engine(model_dir, adapters, **kwargs):
    from moelora_runner import Engine

    kwargs.setdefault("check_host_sync", True)
    kwargs.setdefault("device", rs.DEVICE)
    kwargs.setdefault("max_lora_rank", rs.POOL_RANK)
    kwargs.setdefault("graph", "eager")
    kwargs.setdefault("decode_graph", False)
    engine = Engine(model_dir, **kwargs)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def _requests(adapters, n=8, prompt_len=(4, 16), new=3, seed=5):
    return rs.mixed_requests([None, *adapters], n, seed=seed, prompt_len=prompt_len, max_new_tokens=new,
                             ignore_eos=True)


def test_mixed_batch_matches_hf_peft(deepseek):
    model_dir, adapters, hf = deepseek
    engine = _engine(model_dir, adapters, max_loras=3)
    requests = _requests(adapters)
    assert {r.get("adapter") for r in requests} == {None, *adapters}
    counts = rs.check_against_hf(engine.generate(requests), requests, hf)
    assert counts["compared"] > 0, counts


@pytest.mark.cudagraph
@pytest.mark.parametrize("mode", ["decode_graph", "full", "breakable"])
def test_graphs_match_hf_peft(mode, deepseek):
    model_dir, adapters, hf = deepseek
    engine = _engine(model_dir, adapters, max_loras=3, max_num_batched_tokens=16, kv_cache_tokens=256,
                     decode_batch_buckets=(4,), **gs.MODES[mode])
    requests = _requests(adapters, n=6, prompt_len=(1, 12), seed=21)
    outputs = engine.generate(requests)
    gs.assert_ran_on_graphs(engine, mode)
    rs.check_against_hf(outputs, requests, hf)


@pytest.mark.interpreter
@pytest.mark.parametrize(("backend", "mode"), [("triton", "full"), ("csgmv", "breakable")])
def test_kernel_backends_match_hf_peft(backend, mode, deepseek):
    model_dir, adapters, hf = deepseek
    engine = _engine(model_dir, adapters, max_loras=3, backend=backend, max_num_batched_tokens=16,
                     kv_cache_tokens=256, decode_batch_buckets=(4,), **gs.MODES[mode])
    requests = _requests(adapters, n=4, prompt_len=(2, 6), new=2, seed=9)
    outputs = engine.generate(requests)
    gs.assert_ran_on_graphs(engine, mode)
    rs.check_against_hf(outputs, requests, hf)


def test_every_projection_lora_goes_through_dense_delta(deepseek):
    model_dir, adapters, _ = deepseek
    engine = _engine(model_dir, adapters, max_loras=3)
    calls = []
    inner = engine.backend.dense_delta

    def recording(module, x, out, weights, info):
        calls.append(module)
        return inner(module, x, out, weights, info)

    engine.backend.dense_delta = recording
    engine.generate(_requests([LAYOUT], n=1, prompt_len=(4, 4), new=1))
    mla = ["q_a", "q_b", "kv_a", "kv_b", "o"]
    assert calls[:16] == [*mla, "dense_gate", "dense_up", "dense_down", *mla, "shared_gate", "shared_up",
                          "shared_down"]


@pytest.mark.parametrize("fault", ROUTING_FAULTS)
def test_each_routing_fault_fails_the_comparison(fault, deepseek):
    model_dir, adapters, hf = deepseek
    engine = _engine(model_dir, adapters, max_loras=3)
    make_engine_faulty(engine, fault)
    requests = _requests(adapters, n=4)
    with pytest.raises(AssertionError):
        rs.check_against_hf(engine.generate(requests), requests, hf)
