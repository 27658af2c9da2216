"""The engine on a CUDA device (skipped without one): every fixture family × every built-in backend
against HF + PEFT, in fp32 (TF32 off: the ``engine_vs_hf`` fp32 row) and bf16 (against HF + PEFT in
fp32: the bf16 row), with real Triton kernels, the Triton base MoE path and the host-sync guard as
``set_sync_debug_mode("error")``. Each case writes its measured max / mean |Δlogprob| to
``$MOELORA_GPU_OUT/engine_gpu.jsonl`` when that is set, to set the GPU rows of the tolerance policy.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import runner_support as rs
import torch

from moelora_conformance.fixtures.specs import MODELS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _measure(outputs, requests, hf):
    diffs = []
    for req, out in zip(requests, outputs):
        prompt = req["prompt_token_ids"]
        ref = hf.teacher_forced(req.get("adapter"), prompt + out.output_token_ids, len(prompt))
        diffs += [abs(a - b) for a, b in zip(out.prompt_logprobs[1:] + out.output_logprobs, ref.logprobs)]
    return max(diffs), sum(diffs) / len(diffs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["reference", "triton", "csgmv"])
@pytest.mark.parametrize("model", [m.name for m in MODELS])
def test_engine_on_cuda_matches_hf_peft(model, backend, dtype, fixture_set, engine_adapters, make_engine):
    engine = make_engine(model, backend=backend, dtype=dtype, device="cuda", max_loras=4, max_loras_per_batch=3,
                         max_num_batched_tokens=48, kv_cache_tokens=320)
    names = [n for n, _ in engine_adapters[model]]
    requests = rs.mixed_requests([None, *names], 44, seed=zlib.crc32(model.encode()) % 10_000, ignore_eos=True)
    outputs = engine.generate(requests)
    hf = rs.HFReference(fixture_set.model_dir(model), dict(engine_adapters[model]))
    max_abs, mean_abs = _measure(outputs, requests, hf)
    out_dir = os.environ.get("MOELORA_GPU_OUT")
    if out_dir:
        with open(os.path.join(out_dir, "engine_gpu.jsonl"), "a") as fh:
            fh.write(json.dumps({"model": model, "backend": backend, "dtype": dtype, "moe_impl": engine.moe_impl,
                                 "max_abs": max_abs, "mean_abs": mean_abs,
                                 "device": torch.cuda.get_device_name()}) + "\n")
    counts = rs.check_against_hf(outputs, requests, hf, dtype=dtype)
    if dtype == "float32":
        assert counts["compared"] >= 0.8 * counts["tokens"], counts
