"""The engine on Qwen2-MoE: the gated shared expert beside the routed experts, with its LoRA.

Covers (the whole-model HF + PEFT parity of a mixed batch is ``test_engine_hf_parity.py``'s
``qwen2_moe`` case): the shared expert's three projections go through the backend's
``dense_delta`` as shared_gate / shared_up / shared_down, in that order, after the routed MoE
of every layer; the prefill graphs (``full``, ``breakable``) and the decode graph replay the
shared expert and its LoRA with the tokens and logprobs of HF + PEFT; a Qwen2-MoE whose sliding
window applies to some layers only (``use_sliding_window``) is refused before any weight is read;
the model's byte count includes the shared expert.
"""

from __future__ import annotations

import json
import shutil

import graph_support as gs
import pytest
import runner_support as rs

from moelora_core.checkpoint import UnsupportedModelError

MODEL = "qwen2_moe"


def _hf(fixture_set, engine_adapters):
    return rs.HFReference(fixture_set.model_dir(MODEL), dict(engine_adapters[MODEL]))


def test_the_shared_expert_lora_goes_through_dense_delta(make_engine, engine_adapters):
    engine = make_engine(MODEL, max_loras=4)
    calls = []
    inner = engine.backend.dense_delta

    def recording(module, x, out, weights, info):
        calls.append(module)
        return inner(module, x, out, weights, info)

    engine.backend.dense_delta = recording
    name = next(n for n, _ in engine_adapters[MODEL] if n.endswith("eng-fused-r8"))
    engine.generate(rs.mixed_requests([name], 1, seed=3, prompt_len=(4, 4), max_new_tokens=1, ignore_eos=True))
    per_layer = ["q", "k", "v", "o", "shared_gate", "shared_up", "shared_down"]
    assert calls[:14] == per_layer * 2  # two layers, the prefill step


@pytest.mark.cudagraph
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_graphs_replay_the_shared_expert_as_hf_peft(mode, fixture_set, engine_adapters, make_engine):
    names = [n for n, _ in engine_adapters[MODEL]]
    requests = rs.mixed_requests([None, *names[:3]], 6, seed=21, prompt_len=(1, 10), max_new_tokens=3,
                                 ignore_eos=True)
    engine = make_engine(MODEL, max_loras=2, max_num_batched_tokens=12, kv_cache_tokens=256,
                         decode_batch_buckets=(4,), **gs.MODES[mode])
    outputs = engine.generate(requests)
    gs.assert_ran_on_graphs(engine, mode)
    rs.check_against_hf(outputs, requests, _hf(fixture_set, engine_adapters))


def test_a_per_layer_sliding_window_is_refused(fixture_set, tmp_path):
    from moelora_runner import Engine

    model_dir = tmp_path / "qwen2-window"
    shutil.copytree(fixture_set.model_dir(MODEL), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, use_sliding_window=True, sliding_window=4)))
    with pytest.raises(UnsupportedModelError, match=r"use_sliding_window: Qwen2-MoE's per-layer sliding window"):
        Engine(model_dir)


def test_the_model_bytes_include_the_shared_expert(make_engine):
    model = make_engine(MODEL, adapters=False).model
    shared = sum(t.numel() * t.element_size() for layer in model.layers
                 for t in (layer.w.shared_expert.gate_proj, layer.w.shared_expert.up_proj,
                           layer.w.shared_expert.down_proj, layer.w.shared_expert.gate))
    with_shared = model.bytes()
    for layer in model.layers:
        layer.w.shared_expert = None
    assert with_shared - model.bytes() == shared > 0
