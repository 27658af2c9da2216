"""Where an e2e failure is (``moelora_conformance.e2e.locate``) on a model whose attention is not q/k/v/o.

``test_locate_names_the_mla_module_that_departs``: on DeepSeek-V3 (MLA's q_a / q_b / kv_a / kv_b / o, a
dense first layer, shared experts) a backend whose ``kv_b`` delta is wrong is placed at layer 0's kv_b,
the first module that departs in forward order (the probe once assumed q / k / v / o and answered
"no diagnosis (KeyError: 'q')" on the family).

``test_an_e4m3_crossing_is_told_from_a_fault``: on an fp8 projection, a departure whose inputs differ by
a rounding that straddles one e4m3 midpoint is named an e4m3 crossing; the same departure with anything
more (a delta off, inputs apart, a non-fp8 module, a quantized input off with equal inputs) is not.
"""

from __future__ import annotations

import torch

from moelora_conformance.e2e.locate import e4m3_crossing, locate, module_kind
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


def test_an_e4m3_crossing_is_told_from_a_fault():
    from types import SimpleNamespace

    from moelora_reference.fp8_block import fp8_linear, quantize_activation

    gen = torch.Generator().manual_seed(11)
    block = (8, 8)
    w_q = (torch.randn(12, 16, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = (torch.rand(2, 2, generator=gen) + 0.5) / 64  # outputs of a few units
    lora_b = torch.randn(12, 16, generator=gen) * 0.1
    layer = SimpleNamespace(dense_scales={"o": scale_inv}, weight_block=block, dense=lambda m: w_q,
                            bias=lambda m: None)
    x_want = torch.randn(3, 16, generator=gen)
    x_want[1, 0] = 4.48  # the group's amax: s = 4.48 / 448
    s = quantize_activation(x_want, block[1])[1][1, 0]
    mid = float(100 * s)  # x / s = 100: the midpoint of the e4m3 values 96 and 104
    x_got = x_want.clone()
    x_want[1, 3], x_got[1, 3] = mid * (1 + 2 ** -22), mid * (1 - 2 ** -22)  # either side, a rounding apart
    q_got, q_want = quantize_activation(x_got, block[1])[0], quantize_activation(x_want, block[1])[0]
    assert (q_got != q_want).nonzero().tolist() == [[1, 3]] and {float(q_got[1, 3]), float(q_want[1, 3])} == {96, 104}

    def out(x):  # the w8a8 base plus a delta on the unquantized x (DESIGN.md §1)
        return fp8_linear(x, w_q, scale_inv, block) + x @ lora_b.T

    why = e4m3_crossing(layer, "o", x_got, x_want, out(x_got), out(x_want), "float32")
    assert why is not None and why.startswith("an e4m3 crossing") and "token 1, element 3" in why, why
    assert float((out(x_got) - out(x_want)).abs().max()) > 1e-2  # the crossing departs at the module
    off = out(x_got)
    off[2, 5] += 0.1  # a delta off on top of the crossing
    assert e4m3_crossing(layer, "o", x_got, x_want, off, out(x_want), "float32") is None
    assert e4m3_crossing(layer, "q", x_got, x_want, out(x_got), out(x_want), "float32") is None  # not fp8
    apart = x_got.clone()
    apart[0, 9] += 0.5  # inputs apart: not a rounding
    assert e4m3_crossing(layer, "o", apart, x_want, out(apart), out(x_want), "float32") is None
    # equal inputs, a base that quantized differently: no crossing to blame
    assert e4m3_crossing(layer, "o", x_want, x_want, out(x_got), out(x_want), "float32") is None
