"""Weighted choices whose frequencies hold under Hypothesis' generator.

``st.sampled_from`` and small ``st.integers`` ranges are not uniform under Hypothesis: it favours
the first entries and small values (good for finding bugs, bad for a mix that must meet stated
shares). :func:`weighted` draws a scrambled percentile instead: the generator's favourite raw
values scatter over the range, while the raw value 0 — where shrinking goes — still picks the
first option, so failures shrink towards the simplest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from hypothesis import strategies as st

T = TypeVar("T")
_SCALE = 10_000
_STRIDE = 7_919  # a prime, coprime with _SCALE: u → (u·STRIDE + 1) mod SCALE is a bijection


def weighted(options: Sequence[tuple[T, float]]) -> st.SearchStrategy[T]:
    """One of ``options`` ((value, weight), ...) with probability ∝ weight (first = the simplest)."""
    options = [(v, float(w)) for v, w in options if w > 0]
    if not options:
        raise ValueError("weighted() needs at least one option with a positive weight")
    total = sum(w for _, w in options)

    def pick(u: int) -> T:
        p = ((u * _STRIDE + 1) % _SCALE) / _SCALE * total
        acc = 0.0
        for value, w in options:
            acc += w
            if p < acc:
                return value
        return options[-1][0]

    return st.integers(0, _SCALE - 1).map(pick)


def uniform(options: Sequence[T]) -> st.SearchStrategy[T]:
    """One of ``options`` with equal probability (first = the simplest)."""
    return weighted([(v, 1.0) for v in options])
