"""The vectorised base MoE path against the oracle with no adapter.

Covers: the base layer equals the oracle (fp32, fp16) on drawn cases, sentinel ids included
(-1: nothing; ids in [E, E_base): base only); a token whose every id is -1 gets exactly zero; the
chunked gather gives the same bits for any chunk size; routing equals the oracle's; ids >= E_base
are refused by the eager check; fp32 intermediates round only y.
"""

import pytest
import torch
from hypothesis import given

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import DEFAULT_POLICY, InvalidFieldError, MoEBaseWeights, assert_exact
from moelora_reference import base_moe
from moelora_reference.oracle import moe_block_forward, moe_lora_forward
from moelora_reference.oracle import route_topk as oracle_route_topk

# The float64 loop oracle and the loop twins run on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


@given(case=moe_lora_cases(CAPS))
def test_base_layer_equals_oracle_without_adapters(case, guard):
    m = case.materialize()
    with guard():
        y = base_moe.moe_forward(m.x, m.topk_ids, m.topk_weights, m.base)
    expected = moe_block_forward(m.x, m.topk_ids, m.topk_weights, m.base, None, None)
    DEFAULT_POLICY.assert_close(y, expected, dtype=case.dtype, what=case.describe(), seed=case.seed)
    assert y.dtype == case.dtype


def weights(E_base=3, H=8, I=4, seed=0, dtype=torch.float32):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return MoEBaseWeights(torch.randn(E_base, 2 * I, H, generator=g).to(dtype),
                          torch.randn(E_base, H, I, generator=g).to(dtype), num_experts=2)


def test_expert_not_here_contributes_nothing_and_fused_experts_take_the_base_path():
    base = weights()
    x = torch.randn(3, 8)
    ids = torch.tensor([[-1, -1], [2, -1], [0, 1]], dtype=torch.int32)  # E = 2, E_base = 3
    w = torch.rand(3, 2)
    gate_up = base_moe.gate_up(x, ids, base)
    assert bool((gate_up[0] == 0).all()) and bool((gate_up[1, 1] == 0).all())
    y = base_moe.moe_forward(x, ids, w, base)
    assert bool((y[0] == 0).all())  # every expert elsewhere: exactly zero
    expected = moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, None, None)
    DEFAULT_POLICY.assert_close(y, expected, dtype=torch.float32)


def test_chunk_size_does_not_change_a_bit(monkeypatch):
    base = weights(seed=1)
    x, ids, w = torch.randn(9, 8), torch.randint(-1, 3, (9, 2), dtype=torch.int32), torch.rand(9, 2)
    whole = base_moe.moe_forward(x, ids, w, base)
    monkeypatch.setitem(base_moe.GATHER_BUDGET, "cpu", 1)  # one token per chunk
    assert_exact(base_moe.moe_forward(x, ids, w, base), whole, what="y with one-token chunks")


def test_routing_equals_oracle():
    logits = torch.randn(17, 6, generator=torch.Generator().manual_seed(3))
    for renorm in (False, True):
        w, ids = base_moe.route_topk(logits, 2, renorm)
        w_ref, ids_ref = oracle_route_topk(logits, 2, renorm)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        assert_exact(ids, ids_ref.to(torch.int32), what="topk_ids")
        DEFAULT_POLICY.assert_close(w, w_ref, dtype=torch.float32, what="topk_weights")


def test_ids_past_the_base_experts_are_refused_by_the_eager_check():
    base_moe.check_topk_ids(torch.tensor([[0, 2], [-1, 1]]), 3)
    with pytest.raises(InvalidFieldError, match=r"topk_ids\[1, 0\]"):
        base_moe.check_topk_ids(torch.tensor([[0, 2], [3, 1]]), 3)


@pytest.mark.parametrize("seed", range(4))
def test_intermediate_dtype_controls_the_rounding_points(seed):
    base = weights(dtype=torch.float16, seed=2)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(5, 8, generator=g).half()
    ids = torch.randint(0, 3, (5, 2), generator=g, dtype=torch.int32)
    w = torch.rand(5, 2, generator=g)
    assert base_moe.gate_up(x, ids, base).dtype == torch.float16
    assert base_moe.gate_up(x, ids, base, out_dtype=torch.float32).dtype == torch.float32
    exact = moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, None, None)
    # fp32 intermediates (the default): y is rounded to fp16 once, so it lies within one fp16 ulp of
    # the exact value (a value near a rounding boundary may round either way after fp32 arithmetic).
    y = base_moe.moe_forward(x, ids, w, base)
    ulp = torch.finfo(torch.float16).eps * exact.abs().clamp_min(2.0**-14)
    assert bool(((y.double() - exact).abs() <= ulp).all()), f"seed={seed}: more than one rounding in y"


@pytest.mark.parametrize("shape, field", [((3, 7), "x"), ((3, 8), "topk_ids")])
def test_bad_shapes_raise(shape, field):
    ids = torch.zeros(3, 2, dtype=torch.int32) if field == "x" else torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(InvalidFieldError, match=field):
        base_moe.gate_up(torch.zeros(*shape), ids, weights())
