"""The suite's one reach past Hypothesis' public API: the shrink time bound (``hypothesis_compat``).

Pinned to the Hypothesis release this repository is tested with (6.170.17, through
``ci/constraints``): the internal limit exists, the bound replaces it for its body only and restores
it after (also after an error), and it really stops a slow shrink — a failure still comes out, with
its example, within the bound.
"""

import time

import hypothesis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine

from moelora_conformance.hypothesis_compat import shrink_limit_supported, shrink_time_limit


def test_the_pinned_hypothesis_has_the_shrink_limit():
    assert hypothesis.__version__.startswith("6."), hypothesis.__version__
    assert shrink_limit_supported() and engine.MAX_SHRINKING_SECONDS == 300


def test_the_bound_applies_to_its_body_only():
    with shrink_time_limit(7):
        assert engine.MAX_SHRINKING_SECONDS == 7
    assert engine.MAX_SHRINKING_SECONDS == 300
    with pytest.raises(RuntimeError), shrink_time_limit(3):
        raise RuntimeError("boom")
    assert engine.MAX_SHRINKING_SECONDS == 300
    with shrink_time_limit(None):
        assert engine.MAX_SHRINKING_SECONDS == 300
    with pytest.raises(ValueError, match="positive"), shrink_time_limit(0):
        pass


def test_the_bound_stops_a_slow_shrink():
    calls = []

    @settings(database=None, deadline=None, max_examples=200, derandomize=True, report_multiple_bugs=False)
    @given(st.lists(st.integers(0, 1000), min_size=20, max_size=60))
    def slow(xs):
        time.sleep(0.01)  # every replay of a shrink step costs time, like a slow backend
        calls.append((time.perf_counter(), len(set(xs)) > 10))
        assert len(set(xs)) <= 10

    with pytest.raises(AssertionError), shrink_time_limit(0.3):
        slow()
    first_failure = next(t for t, failed in calls if failed)
    shrinking = calls[-1][0] - first_failure
    # unbounded, this shrink takes 6.4 s (312 calls, measured); the bound stops it after 0.3 s
    assert shrinking < 0.3 + 1.5, (shrinking, len(calls))


def test_a_state_machine_test_takes_a_seed():
    from hypothesis.stateful import RuleBasedStateMachine, rule

    from moelora_conformance.hypothesis_compat import state_machine_test

    seen = []

    class Draws(RuleBasedStateMachine):
        @rule(x=st.integers(0, 10**9))
        def draw(self, x):
            seen.append(x)

    quick = settings(max_examples=3, stateful_step_count=2, database=None, deadline=None)
    runs = []
    for _ in range(2):
        seen.clear()
        state_machine_test(Draws, settings=quick, seed=1234)()
        runs.append(list(seen))
    assert runs[0] and runs[0] == runs[1]  # the same seed draws the same history
