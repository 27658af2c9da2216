"""Where an e2e failure is (``moelora_conformance.e2e.locate``) on a model whose attention is not q/k/v/o.

``test_locate_names_the_mla_module_that_departs``: on DeepSeek-V3 (MLA's q_a / q_b / kv_a / kv_b / o, a
dense first layer, shared experts) a backend whose ``kv_b`` delta is wrong is placed at layer 0's kv_b,
the first module that departs in forward order (the probe once assumed q / k / v / o and answered
"no diagnosis (KeyError: 'q')" on the family).
"""

from __future__ import annotations

import torch

from moelora_conformance.e2e.locate import locate, module_kind
from moelora_conformance.e2e.workload import Workload
from moelora_conformance.fixtures.specs import DEEPSEEK_V3, DEEPSEEK_V3_ADAPTERS


def _engine(model_dir, adapter, path, *, fault: str | None):
    from moelora_runner import Engine

    engine = Engine(model_dir, max_loras=1, max_lora_rank=8, max_num_batched_tokens=16, kv_cache_tokens=64,
                    graph="eager", decode_graph=False, check_host_sync=True)
    engine.load_adapter(adapter, path)
    if fault is not None:  # the module's delta is off by one on every row (a wrong delta, not a rounding)
        backend = engine.runner.backend
        dense = backend.dense_delta

        def dense_delta(module, x, out, *args, **kwargs):
            dense(module, x, out, *args, **kwargs)
            if module == fault:
                out.add_(1.0)

        backend.dense_delta = dense_delta
    return engine


def test_locate_names_the_mla_module_that_departs(fixture_set):
    spec = DEEPSEEK_V3_ADAPTERS[0]
    model_dir, path = fixture_set.model_dir(DEEPSEEK_V3.name), fixture_set.adapter_dir(spec.name)
    ids = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    request = dict(request_id="e2e-0", prompt_token_ids=ids, adapter=spec.name, max_new_tokens=2, ignore_eos=True,
                   prompt_logprobs=True, logprobs=2)
    workload = Workload((request,), (0,), seed=3)

    where = locate("e2e-0 logprobs: max |Δlogprob| ...", workload=workload, reload_weights=None, reference={},
                   make_engine=lambda which: _engine(model_dir, spec.name, path,
                                                     fault="kv_b" if which == "test" else None),
                   mode="eager", dtype="float32", capacity=16)
    assert where is not None and "no diagnosis" not in where, where
    assert "alone (eager) first departs from the reference engine at step 0" in where, where
    assert "layer 0, module kv_b (attention)" in where, where
    assert [module_kind(m) for m in ("q_a", "kv_b", "gate_up", "shared_up", "dense_down")] == \
        ["attention", "attention", "MoE", "shared expert", "dense MLP"]
