"""Routing of every supported family, in one place: the oracle (float64) and the engine (fp32)
call these functions (DESIGN.md §1).

- :func:`route_grouped_sigmoid`: DeepSeek-V3 / Kimi-K2 (transformers 5.17 ``DeepseekV3TopkRouter``)

      p = sigmoid(logits);  q = p + c                    (c = e_score_correction_bias, selection only)
      g_G = sum of the 2 largest q of group G;  keep the topk_group best groups, q = -inf elsewhere
      ids = top_k of q;  w = p[ids];  w /= Σ w + 1e-20 (norm_topk_prob);  w *= routed_scaling_factor

  transformers takes both top-ks with ``sorted=False``; here they are sorted (descending q), and
  nothing may depend on the order (callers compare pairs sorted by expert id).
- :func:`route`: the block's own routing — softmax top-k (``moelora_reference.base_moe.route_topk``)
  or the grouped sigmoid when ``MoEBaseWeights.routing`` says so.

Graph-safe: no host reads, no data-dependent shapes (topk, scatter, masked_fill only).
"""

from __future__ import annotations

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.errors import InvalidFieldError
from moelora_core.routing import GroupLimitedRouting


def route_grouped_sigmoid(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    routing: GroupLimitedRouting,
    renormalize: bool,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's group-limited sigmoid routing (module docstring).

    Args:
        router_logits: [T, E] router logits (any float dtype; computed in ``dtype``).
        correction_bias: [E] ``e_score_correction_bias`` (selection only), or None (zeros).
        top_k: experts per token.
        routing: groups and scaling factor.
        renormalize: ``norm_topk_prob``.
        dtype: the compute dtype (fp32 in the engine, float64 in the oracle).

    Returns:
        (topk_weights [T, k] ``dtype``, topk_ids [T, k] int32), ids by descending biased score.

    Raises:
        InvalidFieldError: E does not split into the groups, or the kept groups hold < top_k experts.
    """
    T, E = router_logits.shape
    routing.check_experts(E, top_k)
    scores = torch.sigmoid(router_logits.to(dtype))  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.to(dtype)
    per_group = E // routing.n_group
    group_scores = choice.view(T, routing.n_group, per_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    group_ids = torch.topk(group_scores, routing.topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(T, routing.n_group, per_group).reshape(T, E)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # the unbiased scores: the bias only selects
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, ids.to(torch.int32)


def route(x: torch.Tensor, top_k: int, moe: MoEBaseWeights, *,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens ``x`` [T, H] through ``moe``'s router with the block's own rule.

    Softmax blocks: logits in x's dtype (``MoEBaseWeights.router_logits``), then fp32 softmax top-k
    (``route_topk``). Group-limited blocks: logits computed in ``dtype`` from x and W_r in ``dtype``,
    as ``DeepseekV3TopkRouter`` does in fp32.

    Returns:
        (topk_weights [T, k], topk_ids [T, k] int32).

    Raises:
        InvalidFieldError: the block holds no router, or its groups do not fit E and top_k.
    """
    from moelora_reference.base_moe import route_topk

    if moe.routing is None:
        weights, ids = route_topk(moe.router_logits(x), top_k, moe.norm_topk_prob)
        return weights.to(dtype), ids
    if moe.router is None:
        raise InvalidFieldError("router", "this MoE block holds no router weight")
    logits = x.to(dtype) @ moe.router.to(dtype).T
    return route_grouped_sigmoid(logits, moe.router_correction_bias, top_k, moe.routing, moe.norm_topk_prob,
                                 dtype=dtype)
