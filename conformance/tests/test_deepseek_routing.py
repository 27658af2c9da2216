"""DeepSeek-V3's group-limited sigmoid routing: moelora's one function against transformers' own
``DeepseekV3TopkRouter`` on random inputs (DESIGN.md §1).

transformers takes its top-ks with ``sorted=False``, so the comparison sorts each token's pairs by
expert id; ids must be equal as sets, weights within the fp32 policy. The configs cover several
groups kept out of many (topk_group < n_group), a correction bias large enough to change the
selection (so using it in the weights, or dropping it from the selection, fails), renormalisation
on and off and a scaling factor != 1. Each named fault below must disagree with transformers.
"""

import pytest
import torch

from moelora_core import DEFAULT_POLICY, GroupLimitedRouting, InvalidFieldError, MoEBaseWeights
from moelora_reference import oracle
from moelora_reference.routing import route, route_grouped_sigmoid

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402

CASES = [  # (E, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    (8, 4, 2, 2, True, 2.5),
    (16, 4, 1, 3, True, 1.5),
    (12, 3, 2, 4, False, 0.7),
    (32, 8, 3, 6, True, 2.827),  # Kimi-K2-like proportions
    (8, 1, 1, 2, True, 1.0),  # one group: plain sigmoid top-k
]


def _hf_router(E, n_group, topk_group, top_k, norm, scale, H, gen):
    cfg = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, n_group=n_group, topk_group=topk_group,
                                        num_experts_per_tok=top_k, norm_topk_prob=norm, routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.5)
    return router


def _by_id(weights, ids):
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _block(router, E, n_group, topk_group, norm, scale):
    return MoEBaseWeights(w_gate_up=torch.zeros(E, 4, router.weight.shape[1]), w_down=torch.zeros(E, router.weight.shape[1], 2),
                          router=router.weight.detach().clone(), norm_topk_prob=norm,
                          routing=GroupLimitedRouting(n_group, topk_group, scale),
                          router_correction_bias=router.e_score_correction_bias.clone())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}-G{}-keep{}-k{}-norm{}-s{}".format(*c))
@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_sigmoid_routing_equals_transformers(case, seed):
    E, n_group, topk_group, top_k, norm, scale = case
    H = 24
    gen = torch.Generator().manual_seed(1000 * seed + E)
    router = _hf_router(E, n_group, topk_group, top_k, norm, scale, H, gen)
    x = torch.randn(64, H, generator=gen)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
    hf_w, hf_ids = _by_id(hf_w, hf_ids)
    block = _block(router, E, n_group, topk_group, norm, scale)
    for dtype, (w, ids) in (("fp32 engine", route(x, top_k, block)), ("float64 oracle", oracle.route_block(x, top_k, block))):
        w, ids = _by_id(w, ids)
        assert torch.equal(ids, hf_ids), dtype
        rep = DEFAULT_POLICY.check(w.float(), hf_w, dtype=torch.float32, what=f"routing weights ({dtype})", seed=seed)
        assert rep.ok, rep.message()
    # the function itself on transformers' own logits (the renormalising sum's order differs with
    # the top-k order, so the weights are equal within rounding, not bitwise)
    w, ids = _by_id(*route_grouped_sigmoid(logits, router.e_score_correction_bias, top_k,
                                           GroupLimitedRouting(n_group, topk_group, scale), norm))
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=0)


def _faulty(kind, logits, bias, top_k, routing, norm):
    """The family's routing faults (DESIGN.md §1), each one line away from the right function."""
    if kind == "bias in the weights":
        p = torch.sigmoid(logits)
        _, ids = route_grouped_sigmoid(logits, bias, top_k, routing, norm)
        w = (p + bias).gather(1, ids.long())
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if norm else w
        return w * routing.routed_scaling_factor, ids
    if kind == "no group limit":
        return route_grouped_sigmoid(logits, bias, top_k, GroupLimitedRouting(1, 1, routing.routed_scaling_factor), norm)
    if kind == "scaling twice":
        w, ids = route_grouped_sigmoid(logits, bias, top_k, routing, norm)
        return w * routing.routed_scaling_factor, ids
    if kind == "bias ignored":
        return route_grouped_sigmoid(logits, None, top_k, routing, norm)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["bias in the weights", "no group limit", "scaling twice", "bias ignored"])
def test_each_routing_fault_disagrees_with_transformers(kind):
    E, n_group, topk_group, top_k, norm, scale = CASES[0]
    gen = torch.Generator().manual_seed(7)
    router = _hf_router(E, n_group, topk_group, top_k, norm, scale, 24, gen)
    x = torch.randn(64, 24, generator=gen)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
    hf_w, hf_ids = _by_id(hf_w, hf_ids)
    w, ids = _by_id(*_faulty(kind, logits, router.e_score_correction_bias, top_k,
                             GroupLimitedRouting(n_group, topk_group, scale), norm))
    same_ids = torch.equal(ids, hf_ids)
    assert not (same_ids and DEFAULT_POLICY.check(w, hf_w, dtype=torch.float32, what=kind, seed=7).ok)


def test_bad_groups_are_refused_by_name():
    logits = torch.randn(4, 8)
    with pytest.raises(InvalidFieldError, match="n_group"):
        route_grouped_sigmoid(logits, None, 2, GroupLimitedRouting(3, 1, 1.0), True)  # 8 experts, 3 groups
    with pytest.raises(InvalidFieldError, match="topk_group"):
        route_grouped_sigmoid(logits, None, 5, GroupLimitedRouting(4, 2, 1.0), True)  # 2 groups of 2 < 5
    with pytest.raises(InvalidFieldError, match="topk_group"):
        GroupLimitedRouting(4, 5, 1.0)
    with pytest.raises(InvalidFieldError, match="routed_scaling_factor"):
        GroupLimitedRouting(4, 2, 0.0)
    with pytest.raises(InvalidFieldError, match="router_correction_bias"):
        MoEBaseWeights(w_gate_up=torch.zeros(8, 4, 6), w_down=torch.zeros(8, 6, 2), router_correction_bias=torch.zeros(8))
