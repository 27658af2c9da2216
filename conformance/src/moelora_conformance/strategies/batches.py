"""Batch structure: forward kind, ragged request lengths and which adapter each request uses.

- Forward kinds (:data:`FORWARD_KINDS`): ``extend`` (fresh prefill), ``decode`` (every request the
  same length: 1, or 2-4 for speculative verification), ``mixed`` (an EXTEND batch of chunked
  prefills and decode-like requests, ``prefix_len > 0``), ``idle`` (zero requests).
- Request counts by size class: ``small`` 1-4, ``medium`` 5-32, ``large`` 33 up to the caps (past
  the 32-request cap some public engines had); lengths include 1 and one long request at times.
- Adapter modes (:data:`ADAPTER_MODES`): ``uniform`` over base and every slot (rank-0 slots
  included, whose tokens behave as base), ``all_base``, ``one_adapter``, ``zipf`` (popularity
  ∝ 1/rank^1.1 over a drawn order of slots), ``alternating`` base/adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from moelora_conformance.profiles import SizeCaps, current_profile
from moelora_conformance.strategies.choice import uniform, weighted
from moelora_core.batch import BatchSpec, Request
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER

FORWARD_KINDS = ("extend", "decode", "mixed", "idle")
ADAPTER_MODES = ("uniform", "all_base", "one_adapter", "zipf", "alternating")
SIZE_CLASSES = ("small", "medium", "large")
_SIZE_RANGES = {"small": (1, 4), "medium": (5, 32), "large": (33, None)}
_ZIPF_EXPONENT = 1.1
# Large batches must be >= 20 % of all draws (DESIGN.md §7); IDLE is rare but always drawable.
_KIND_WEIGHTS = {"extend": 35, "decode": 30, "mixed": 24, "idle": 11}
_SIZE_WEIGHTS = (("small", 20), ("medium", 25), ("large", 55))
_MODE = {"extend": ForwardMode.EXTEND, "mixed": ForwardMode.EXTEND, "decode": ForwardMode.DECODE,
         "idle": ForwardMode.IDLE}


@dataclass(frozen=True)
class BatchPlan:
    """A drawn batch and how it was drawn (for statistics and repro lines)."""

    batch: BatchSpec
    kind: str
    adapter_mode: str
    size_class: str

    def describe(self) -> str:
        b = self.batch
        # prefix lengths shown: a mixed batch (chunks and decodes, prefix_len > 0) reads as one
        return (f"{self.kind} bs={b.bs} T={b.num_tokens} adapters={self.adapter_mode} "
                f"prefix={runs(r.prefix_len for r in b.requests)} slots={runs(b.req_weight_indices)}")


def runs(values) -> str:
    """Every entry of ``values``, a run of three or more equal entries written ``v×n``: a case line
    shows every request's slot (a trigger at the 33rd request stays visible) without 128 numbers."""
    out: list[str] = []
    values = list(values)
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        n = j - i
        out += [f"{values[i]}×{n}"] if n >= 3 else [str(values[i])] * n
        i = j
    return "[" + ", ".join(out) + "]"


def _zipf_slot(u: int, order: list[int]) -> int:
    """Inverse CDF of a Zipf law over ``order`` (most popular first) at u / 1000."""
    weights = [1.0 / (i + 1) ** _ZIPF_EXPONENT for i in range(len(order))]
    target, acc = (u / 1000.0) * sum(weights), 0.0
    for slot, w in zip(order, weights):
        acc += w
        if target < acc:
            return slot
    return order[-1]


@st.composite
def _adapter_ids(draw, n: int, max_loras: int, lora_ranks: tuple[int, ...], mode: str) -> list[int]:
    live = [s for s in range(max_loras) if lora_ranks[s] > 0] or list(range(max_loras))
    if mode == "all_base":
        return [NO_ADAPTER] * n
    if mode == "uniform":
        return [draw(st.integers(NO_ADAPTER, max_loras - 1)) for _ in range(n)]
    if mode == "one_adapter":
        return [draw(uniform(live))] * n
    if mode == "alternating":
        slot, offset = draw(uniform(live)), draw(st.integers(0, 1))
        return [NO_ADAPTER if (i + offset) % 2 == 0 else slot for i in range(n)]
    order = draw(st.permutations(live))
    return [_zipf_slot(draw(st.integers(0, 999)), order) for _ in range(n)]


@st.composite
def batch_plans(
    draw,
    max_loras: int,
    lora_ranks: tuple[int, ...] | None = None,
    scalings: tuple[float, ...] | None = None,
    caps: SizeCaps | None = None,
    *,
    kinds: tuple[str, ...] = FORWARD_KINDS,
    adapter_modes: tuple[str, ...] = ADAPTER_MODES,
    max_tokens: int | None = None,
) -> BatchPlan:
    """A ``BatchPlan`` for a pool of ``max_loras`` slots.

    Args:
        max_loras: slots of the pool.
        lora_ranks, scalings: the pool's per-slot rank and σ (drawn, some slots empty, if None).
        caps: size caps (default: the loaded profile's).
        kinds: forward kinds to draw from. adapter_modes: adapter modes to draw from.
        max_tokens: token cap (default ``caps.max_tokens``).
    """
    caps = caps if caps is not None else current_profile().caps
    max_tokens = caps.max_tokens if max_tokens is None else max_tokens
    if lora_ranks is None:
        lora_ranks = tuple(draw(st.integers(0, caps.max_rank)) for _ in range(max_loras))
    if scalings is None:
        scalings = tuple(0.0 if r == 0 else draw(st.sampled_from((0.5, 1.0, 2.0))) for r in lora_ranks)
    kind = draw(weighted([(k, _KIND_WEIGHTS[k]) for k in kinds]))
    mode = draw(uniform(adapter_modes))
    size = draw(weighted(_SIZE_WEIGHTS))
    if kind == "idle":
        batch = BatchSpec(ForwardMode.IDLE, (), max_loras, lora_ranks, scalings)
        return BatchPlan(batch, kind, mode, "idle")

    tpr = 1
    if kind == "decode" and size != "large":
        tpr = draw(st.sampled_from((1, 2, 4)))
    most = min(caps.max_requests, max_tokens // tpr)
    lo, hi = _SIZE_RANGES[size]
    hi = most if hi is None else min(hi, most)
    lo = min(lo, hi)
    if lo > hi or hi < 1:
        raise ValueError(f"no batch fits {max_tokens} tokens")
    n = draw(st.integers(lo, hi))
    size = next(c for c, (a, b) in _SIZE_RANGES.items() if n >= a and (b is None or n <= b))

    if kind == "decode":
        lens = [tpr] * n
    else:
        per = max(1, max_tokens // n)
        lens = [draw(st.integers(1, per)) for _ in range(n)]
        if draw(st.booleans()):  # one long request among short ones
            i = draw(st.integers(0, n - 1))
            lens[i] = draw(st.integers(1, max_tokens - (sum(lens) - lens[i])))
    if kind == "extend":
        prefixes = [0] * n
    elif kind == "decode":
        prefixes = [draw(st.integers(1, 4096)) for _ in range(n)]
    else:  # mixed: chunked prefills and decode-like requests
        prefixes = []
        for i in range(n):
            if draw(st.booleans()):
                lens[i] = 1
            prefixes.append(draw(st.integers(0 if i else 1, 4096)))
    slots = draw(_adapter_ids(n, max_loras, lora_ranks, mode))
    requests = [Request(s, length, p) for s, length, p in zip(slots, lens, prefixes)]
    batch = BatchSpec(_MODE[kind], requests, max_loras, lora_ranks, scalings)
    return BatchPlan(batch, kind, mode, size)


def batch_specs(max_loras: int, lora_ranks: tuple[int, ...] | None = None,
                scalings: tuple[float, ...] | None = None, caps: SizeCaps | None = None,
                **kwargs) -> st.SearchStrategy[BatchSpec]:
    """The ``BatchSpec`` of :func:`batch_plans` alone (for kernel tests)."""
    return batch_plans(max_loras, lora_ranks, scalings, caps, **kwargs).map(lambda plan: plan.batch)
