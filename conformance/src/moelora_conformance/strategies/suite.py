"""Strategies the conformance properties draw besides whole cases: cases per harness mode, more
batches on a case's adapter pool (histories, batch sequences, larger batches), and graph
capacities.

Harness modes (:data:`LAYER_MODES`): ``eager``; ``decode`` (the decode graph family: DECODE and
IDLE batches); ``prefill-full`` and ``prefill-breakable`` (the prefill family: EXTEND batches,
fresh or chunked, and IDLE). Family-level properties (metadata, addresses, fallback) use the
family names ``decode`` and ``prefill`` (:data:`FAMILY_MODES`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import strategies as st

from moelora_conformance.profiles import SizeCaps
from moelora_conformance.strategies.cases import MoELoRACase, moe_lora_cases
from moelora_conformance.strategies.choice import uniform, weighted
from moelora_core.batch import BatchSpec, Request
from moelora_core.capabilities import Capabilities
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER

#: Modes of the layer harness.
LAYER_MODES: tuple[str, ...] = ("eager", "decode", "prefill-full", "prefill-breakable")
#: Graph families, for properties of metadata and static buffers.
FAMILY_MODES: tuple[str, ...] = ("decode", "prefill")
#: Forward kinds (``strategies.batches.FORWARD_KINDS``) each mode runs.
MODE_KINDS: dict[str, tuple[str, ...]] = {
    "eager": ("extend", "decode", "mixed", "idle"),
    "decode": ("decode", "idle"),
    "prefill-full": ("extend", "mixed", "idle"),
    "prefill-breakable": ("extend", "mixed", "idle"),
    "prefill": ("extend", "mixed", "idle"),
}
#: How request adapters are drawn by :func:`pool_batches`.
ADAPTER_DRAWS: tuple[str, ...] = ("mixed", "all_base", "adapters")


def family_of(mode: str) -> str | None:
    """The graph family of a mode (None for eager)."""
    if mode == "eager":
        return None
    return "decode" if mode == "decode" else "prefill"


def suite_caps(caps: SizeCaps, capabilities: Capabilities) -> SizeCaps:
    """The profile's caps bounded by what the backend declares (max requests, max rank)."""
    out = caps
    if capabilities.max_requests is not None:
        out = replace(out, max_requests=min(out.max_requests, capabilities.max_requests))
    if capabilities.max_rank is not None:
        out = replace(out, max_rank=min(out.max_rank, capabilities.max_rank))
    return out


def suite_cases(caps: SizeCaps, mode: str, dtype: torch.dtype, *, virtual_experts: bool | None,
                kinds: tuple[str, ...] | None = None, large_offsets: bool = False,
                **kwargs) -> st.SearchStrategy[MoELoRACase]:
    """Whole cases for ``mode`` (its forward kinds, intersected with ``kinds``) in ``dtype``.

    Args:
        virtual_experts: None = drawn (the backend declares them), False = never.
        large_offsets: also draw the large-offset case (weight 1 in 16; Hypothesis' mutations of
            earlier examples make the realised share lower, 0-4 in 200 measured) where the caps allow
            it and the mode is eager (``strategies.large_offsets``; the GPU tests of
            test_suite_large_offsets.py run the case itself on every backend).
        kwargs: passed to :func:`~.cases.moe_lora_cases` (adapter_modes, routing_modes).
    """
    allowed = MODE_KINDS[mode]
    if kinds is not None:
        allowed = tuple(k for k in allowed if k in kinds) or allowed
    drawn = moe_lora_cases(caps, kinds=allowed, dtype=dtype, virtual_experts=virtual_experts, **kwargs)
    if not (large_offsets and caps.large_offsets and mode == "eager" and "extend" in allowed):
        return drawn
    from moelora_conformance.strategies.large_offsets import large_offset_case

    large = st.integers(0, 2**31 - 1).map(lambda seed: large_offset_case(dtype, seed=seed))
    return weighted([(False, 15), (True, 1)]).flatmap(lambda big: large if big else drawn)


def live_slots(batch: BatchSpec) -> list[int]:
    """Slots of the pool with rank > 0."""
    return [s for s, r in enumerate(batch.lora_ranks) if r > 0]


@st.composite
def pool_batches(draw, like: BatchSpec, forward_mode: ForwardMode, num_requests: int, *, max_tokens: int,
                 tokens_per_request: int = 1, adapters: str = "mixed") -> BatchSpec:
    """A batch of ``num_requests`` requests on ``like``'s pool (its slots, ranks and σ).

    Args:
        like: a batch of the pool (only ``max_loras``, ``lora_ranks``, ``scalings`` are used).
        forward_mode: EXTEND, DECODE or IDLE (IDLE ignores the rest).
        num_requests: requests (>= 1 unless IDLE).
        max_tokens: token budget (EXTEND lengths are drawn within it; DECODE needs
            ``num_requests * tokens_per_request <= max_tokens``).
        tokens_per_request: DECODE length of every request.
        adapters: "mixed" (base or any slot, empty slots included), "all_base", "adapters" (live
            slots only; base if the pool has none).
    """
    pool = (like.max_loras, like.lora_ranks, like.scalings)
    if forward_mode is ForwardMode.IDLE or num_requests == 0:
        return BatchSpec(ForwardMode.IDLE, (), *pool)
    slots = live_slots(like)
    ids = []
    for _ in range(num_requests):
        if adapters == "all_base" or (adapters == "adapters" and not slots):
            ids.append(NO_ADAPTER)
        elif adapters == "adapters":
            ids.append(draw(uniform(slots)))
        else:
            ids.append(draw(st.integers(NO_ADAPTER, like.max_loras - 1)))
    if forward_mode is ForwardMode.DECODE:
        if num_requests * tokens_per_request > max_tokens:
            raise ValueError(f"{num_requests} decode requests of {tokens_per_request} tokens exceed {max_tokens}")
        requests = [Request(s, tokens_per_request, draw(st.integers(1, 4096))) for s in ids]
        return BatchSpec(ForwardMode.DECODE, requests, *pool)
    if num_requests > max_tokens:
        raise ValueError(f"{num_requests} requests exceed {max_tokens} tokens")
    per = max(1, max_tokens // num_requests)
    lens = [draw(st.integers(1, per)) for _ in range(num_requests)]
    if draw(st.booleans()):  # one long request among short ones
        i = draw(st.integers(0, num_requests - 1))
        lens[i] = draw(st.integers(lens[i], max_tokens - (sum(lens) - lens[i])))
    chunked = draw(st.booleans())
    requests = [Request(s, n, draw(st.integers(0, 4096)) if chunked else 0) for s, n in zip(ids, lens)]
    return BatchSpec(ForwardMode.EXTEND, requests, *pool)


def mode_forward(mode: str, like: BatchSpec) -> ForwardMode:
    """The forward mode of extra batches in ``mode``: DECODE in the decode family, EXTEND in the
    prefill family, and in eager mode that of ``like`` (EXTEND for IDLE)."""
    if mode == "decode":
        return ForwardMode.DECODE
    if mode == "eager" and like.forward_mode is ForwardMode.DECODE:
        return ForwardMode.DECODE
    return ForwardMode.EXTEND


def tokens_per_request(batch: BatchSpec, default: int = 1) -> int:
    """The DECODE length of ``batch`` (``default`` for IDLE and EXTEND)."""
    return batch.tokens_per_request if batch.forward_mode is ForwardMode.DECODE else default
