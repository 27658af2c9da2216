"""Inputs of ``moe_lora_align_block_size`` (DESIGN.md §4) for the twin's and the kernel's tests.

An :class:`AlignProblem` is a drawn batch (its tokens' slots), a routing plan, BLOCK_M, a graph
capacity tail (rows past the live tokens: mapping -1, stale expert ids) and which slots are enabled.
``materialize`` builds the tensors from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from moelora_conformance.profiles import SizeCaps, current_profile
from moelora_conformance.strategies.batches import BatchPlan, batch_plans
from moelora_conformance.strategies.routing import RoutingPlan, routing_plans
from moelora_core.sentinels import NO_ADAPTER

#: How ``adapter_enabled`` is passed: None, the batch's own, or the batch's with some used slots off.
ENABLED_MODES = ("none", "batch", "some_disabled")


@dataclass(frozen=True)
class AlignProblem:
    """One call of ``moe_lora_align_block_size``.

    Attributes:
        plan: the batch; its ``token_lora_mapping`` fills the live rows.
        tail: rows past the live tokens (a graph capacity): mapping -1, stale ids.
        routing: the routing plan of all ``num_tokens`` rows.
        block_m: BLOCK_M.
        enabled_mode: one of :data:`ENABLED_MODES`. disabled: slots switched off in ``some_disabled``.
        seed: the value seed (the routing plan's).
    """

    plan: BatchPlan
    tail: int
    routing: RoutingPlan
    block_m: int
    enabled_mode: str
    disabled: tuple[int, ...]

    @property
    def seed(self) -> int:
        return self.routing.seed

    @property
    def num_tokens(self) -> int:
        """M, live tokens plus the tail."""
        return self.plan.batch.num_tokens + self.tail

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    @property
    def max_loras(self) -> int:
        return self.plan.batch.max_loras

    def materialize(self, device: torch.device | str = "cpu"):
        """(topk_ids [M, k] int32, token_lora_mapping [M] int32, adapter_enabled [L] int32 or None)."""
        mapping = [*self.plan.batch.token_lora_mapping, *([NO_ADAPTER] * self.tail)]
        ids, _, _ = self.routing.materialize(self.num_tokens, device, token_slots=mapping)
        mapping_t = torch.tensor(mapping, dtype=torch.int32, device=device)
        if self.enabled_mode == "none":
            return ids, mapping_t, None
        enabled = [0 if s in self.disabled else v for s, v in enumerate(self.plan.batch.adapter_enabled)]
        return ids, mapping_t, torch.tensor(enabled, dtype=torch.int32, device=device)

    def describe(self) -> str:
        return (f"seed={self.seed} M={self.num_tokens} (tail {self.tail}) k={self.top_k} E={self.num_experts} "
                f"block_m={self.block_m} L={self.max_loras} enabled={self.enabled_mode}{list(self.disabled)} "
                f"{self.routing.describe()} {self.plan.describe()}")


@st.composite
def align_problems(
    draw, caps: SizeCaps | None = None, *, block_sizes: tuple[int, ...] = (16, 32, 64), max_tail: int = 16
) -> AlignProblem:
    """An ``AlignProblem`` within ``caps`` (default: the loaded profile's).

    Args:
        block_sizes: BLOCK_M values to draw (Triton needs >= 16; the twin takes any >= 1).
        max_tail: largest graph capacity tail.
    """
    caps = caps if caps is not None else current_profile().caps
    E = draw(st.integers(1, caps.max_experts))
    k = draw(st.integers(1, min(caps.max_top_k, E)))
    extra = draw(st.integers(0, 2))
    L = draw(st.integers(1, caps.max_loras))
    ranks = tuple(draw(st.sampled_from((1, 1, 0))) for _ in range(L))
    tail = draw(st.integers(0, min(max_tail, caps.max_tokens - 1)))
    plan = draw(batch_plans(L, ranks, tuple(float(r) for r in ranks), caps, max_tokens=caps.max_tokens - tail))
    routing = draw(routing_plans(E, k, E + extra))
    block_m = draw(st.sampled_from(block_sizes))
    mode = draw(st.sampled_from(ENABLED_MODES))
    disabled = ()
    if mode == "some_disabled":
        used = [s for s, v in enumerate(plan.batch.adapter_enabled) if v]
        disabled = tuple(s for s in used if draw(st.booleans()))
    return AlignProblem(plan, tail, routing, block_m, mode, disabled)
