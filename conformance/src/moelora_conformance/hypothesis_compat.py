"""The one place the suite reaches past Hypothesis' public API (pinned by
``tests/test_hypothesis_compat.py``).

Hypothesis stops shrinking one failure after a fixed five minutes
(``hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS``, no setting). A conformance run on
two CPU cores under the Triton interpreter spends most of that time replaying a slow backend, so
the first counterexample came after up to 559 s; the suite's profiles bound it instead
(``Profile.shrink_seconds``). :func:`shrink_time_limit` sets the bound for the body and restores
Hypothesis' value afterwards. With the attribute gone (a Hypothesis release that renamed it) the
bound is a no-op and the test named above fails, so the change is noticed.

:func:`state_machine_test` reaches ``hypothesis.stateful.get_state_machine_test`` (what the public
``run_state_machine_as_test`` calls) so that a state machine's run can take ``hypothesis.seed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

try:  # the internal module is present in every Hypothesis 6 release the suite supports
    from hypothesis.internal.conjecture import engine as _engine
except ImportError:  # pragma: no cover - a Hypothesis without it: the bound becomes a no-op
    _engine = None

_ATTRIBUTE = "MAX_SHRINKING_SECONDS"


def shrink_limit_supported() -> bool:
    """Whether this Hypothesis has the shrink time limit the suite sets."""
    return _engine is not None and isinstance(getattr(_engine, _ATTRIBUTE, None), int | float)


@contextlib.contextmanager
def shrink_time_limit(seconds: float | None) -> Iterator[None]:
    """Bound Hypothesis' shrinking of one failure to ``seconds`` (None: Hypothesis' own limit) in the body.

    Raises:
        ValueError: ``seconds`` not positive.
    """
    if seconds is None or not shrink_limit_supported():
        yield
        return
    if seconds <= 0:
        raise ValueError(f"a shrink time limit must be positive, got {seconds!r}")
    previous = getattr(_engine, _ATTRIBUTE)
    setattr(_engine, _ATTRIBUTE, seconds)
    try:
        yield
    finally:
        setattr(_engine, _ATTRIBUTE, previous)


def state_machine_test(machine: type, *, settings, seed: int | None = None):
    """The ``@given`` test that runs the ``RuleBasedStateMachine`` subclass ``machine`` (what
    ``run_state_machine_as_test`` builds and calls), with ``hypothesis.seed(seed)`` applied when a seed
    is given: the public runner takes no seed, and a state machine's failure must be replayable
    (``moelora_conformance.e2e.stateful``).

    Returns:
        A callable that runs the machine (raises the failure, with its steps in the notes).
    """
    import hypothesis
    from hypothesis.stateful import get_state_machine_test

    test = get_state_machine_test(machine, settings=settings)
    return test if seed is None else hypothesis.seed(seed)(test)
