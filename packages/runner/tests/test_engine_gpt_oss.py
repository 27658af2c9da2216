"""The engine on GPT-OSS against HF transformers + PEFT (DESIGN.md §1).

A tiny ``GptOssForCausalLM`` (the fixtures builder's ``GPT_OSS`` spec: random weights,
``save_pretrained``; q/k/v/o biases, per-head sinks, a sliding window of 4 on layer 0 and full
attention on layer 1, router and expert biases, interleaved gate/up, the clamped swiglu_oai) and two
PEFT adapters (``target_parameters`` on gate_up_proj / down_proj + q/k/v/o at r 8; rsLoRA r 4 + q/v),
built in a temporary directory. Covers: a mixed batch (base and both adapters, prompts longer than
the window) on the reference backend, and on the triton backend over the Triton base path, against HF + PEFT (logprobs within
the ``engine_vs_hf`` row, greedy tokens where the margin allows); the sinks and the per-layer window
matter (the same run without sinks, with the window on every layer or on none, fails the comparison:
``test_without_sinks_or_with_the_wrong_windows_it_fails``).
"""

from __future__ import annotations

import pytest
import runner_support as rs

from moelora_conformance.fixtures.specs import GPT_OSS, GPT_OSS_ADAPTERS


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from moelora_conformance.fixtures.adapters import build_fused_adapter
    from moelora_conformance.fixtures.models import save_model

    root = tmp_path_factory.mktemp("gpt_oss_engine")
    save_model(GPT_OSS, root / "model")
    adapters = {}
    for spec in GPT_OSS_ADAPTERS:
        build_fused_adapter(spec, GPT_OSS, root / spec.name)
        adapters[spec.name] = root / spec.name
    return root / "model", adapters, rs.HFReference(root / "model", adapters)


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


def _requests(adapters, n=9, prompt_len=(5, 12), new=3):
    return rs.mixed_requests([None, *adapters], n, seed=5, prompt_len=prompt_len, max_new_tokens=new, ignore_eos=True)


def test_mixed_batch_matches_hf_peft(gpt_oss):
    model_dir, adapters, hf = gpt_oss
    engine = _engine(model_dir, adapters, max_loras=2)
    assert engine.model.windows == [GPT_OSS.sliding_window, None]
    requests = _requests(adapters)
    counts = rs.check_against_hf(engine.generate(requests), requests, hf)
    assert counts["compared"] > 0, counts


def test_without_sinks_or_with_the_wrong_windows_it_fails(gpt_oss):
    model_dir, adapters, hf = gpt_oss
    requests = _requests(adapters, n=3)
    for fault in ("no sinks", "one window", "no window"):
        engine = _engine(model_dir, adapters, max_loras=2)
        if fault == "no sinks":
            for layer in engine.model.layers:
                layer.w.sinks = None
        elif fault == "one window":
            engine.model.windows = [GPT_OSS.sliding_window] * len(engine.model.windows)
        else:
            engine.model.windows = [None] * len(engine.model.windows)
        with pytest.raises(AssertionError):
            rs.check_against_hf(engine.generate(requests), requests, hf)


@pytest.mark.interpreter
def test_triton_backend_matches_hf_peft(gpt_oss):
    model_dir, adapters, hf = gpt_oss
    # the Triton base path too: swiglu_oai and the expert biases in the kernels' epilogues
    engine = _engine(model_dir, adapters, max_loras=2, backend="triton", moe_impl="triton")
    requests = _requests(adapters, n=3, prompt_len=(5, 6), new=2)
    rs.check_against_hf(engine.generate(requests), requests, hf)
