"""How an MoE block chooses its experts: the router's kind and parameters (DESIGN.md §1).

Two kinds:

- softmax (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GPT-OSS): fp32 softmax over the router logits,
  top-k, optional renormalisation (``MoEBaseWeights.norm_topk_prob``); ``MoEBaseWeights.routing``
  is None.
- group-limited sigmoid (DeepSeek-V3 / Kimi-K2, transformers 5.17 ``DeepseekV3TopkRouter``):
  :class:`GroupLimitedRouting`. The equation and the one function that computes it are in
  ``moelora_reference.routing``; the correction bias [E] is a tensor of the block
  (``MoEBaseWeights.router_correction_bias``), the scalars live here.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora_core.errors import InvalidFieldError


@dataclass(frozen=True)
class GroupLimitedRouting:
    """DeepSeek-V3's router: sigmoid scores, selection with a correction bias among the best
    ``topk_group`` of ``n_group`` expert groups, weights renormalised (``norm_topk_prob`` of the
    block) and multiplied by ``routed_scaling_factor``.

    Attributes:
        n_group: G, the number of equal expert groups (E divisible by G, at least 2 experts a group:
            a group's score is the sum of its two best scores).
        topk_group: the groups kept, 1 <= topk_group <= n_group.
        routed_scaling_factor: multiplies the routed weights (never the shared experts).

    Raises:
        InvalidFieldError: a non-positive group count, topk_group outside [1, n_group], or a
            scaling factor that is not a positive finite number.
    """

    n_group: int
    topk_group: int
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        if self.n_group < 1:
            raise InvalidFieldError("n_group", f"must be >= 1, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise InvalidFieldError("topk_group", f"must be in [1, {self.n_group}], got {self.topk_group}")
        if not 0 < self.routed_scaling_factor < float("inf"):
            raise InvalidFieldError("routed_scaling_factor", f"must be > 0, got {self.routed_scaling_factor}")

    def check_experts(self, num_experts: int, top_k: int) -> None:
        """Raise InvalidFieldError unless ``num_experts`` splits into ``n_group`` groups of at least
        two experts and the kept groups hold at least ``top_k`` experts."""
        if num_experts % self.n_group or num_experts // self.n_group < 2:
            raise InvalidFieldError("n_group", f"{num_experts} experts do not split into {self.n_group} groups "
                                               "of at least 2")
        if top_k > self.topk_group * (num_experts // self.n_group):
            raise InvalidFieldError("topk_group", f"{self.topk_group} groups of {num_experts // self.n_group} "
                                                  f"experts hold fewer than top_k={top_k}")
