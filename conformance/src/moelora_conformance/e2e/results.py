"""The e2e suite's result record: one property × backend × mode × dtype × model, with an outcome in
the layer suite's words (:data:`moelora_conformance.report.OUTCOMES`), so the e2e report, the
expected-failure manifest and the support matrix are the layer suite's own (DESIGN.md §7, §9).

Every part of the e2e suite returns these: the workload checks (:mod:`.checks`), and the
stateful engine properties (``moelora_conformance.e2e.stateful.run_state_machine``). A record is
``not_run`` until a check decides it: nothing that did not finish is ever reported as passed.

Two outcomes say a claim held but is not proven (``conformance/docs/suite.md``, "Statuses"):
``partial`` (a claim with coverage items — E05 — whose items were not all met: ``coverage`` says which)
and ``not_meaningful`` (the claim relied only on no-op adapters: it held for the base model only). Neither
fails a run unless ``--require-coverage`` is given.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

#: Engine modes of the e2e suite (DESIGN.md §6): eager; eager prefills + the decode graph; prefill
#: ``full`` + the decode graph; prefill ``breakable`` + the decode graph.
E2E_MODES: tuple[str, ...] = ("eager", "decode_graph", "full", "breakable")
#: The mode of a record whose run mixes the engine modes (e.g. a state machine that switches them).
MIXED_MODE = "mixed"
#: dtype names of the records (the layer suite's).
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass
class E2EResult:
    """One checked claim of the e2e suite.

    Attributes:
        property: the stable e2e property id ("E01".., :data:`moelora_conformance.e2e.properties.E2E_PROPERTIES`).
        backend: the backend as given ("reference", "triton", "csgmv", "module:factory").
        mode: one of :data:`E2E_MODES`, or :data:`MIXED_MODE`.
        dtype: "fp32" / "fp16" / "bf16" (:data:`DTYPE_NAMES`).
        model: the model it ran on (fixture name, or the directory's name).
        outcome: "passed", "failed", "partial", "not_meaningful", "not_run", "not_implemented" (later
            "xfailed" / "xpassed" from the manifest); :data:`moelora_conformance.report.OUTCOMES`.
        message: the first line of a failure, why it did not run, or why it is not proven.
        coverage: the claim's coverage items → "met", "not met (...)" or "not applicable ..." (E05);
            empty for claims without items.
        duration: seconds.
        details: what was measured (counts, max |Δlogprob|, tokens compared, passes by label), JSON-able.
        repro: a command (or a seed) that replays it, or None.
    """

    property: str
    backend: str
    mode: str
    dtype: str
    model: str
    outcome: str = "not_run"
    message: str = ""
    duration: float = 0.0
    details: dict = field(default_factory=dict)
    repro: str | None = None
    coverage: dict[str, str] = field(default_factory=dict)

    @property
    def test(self) -> str:
        """The item's name in reports: ``E01[triton-full-fp32-qwen3_moe]``."""
        return f"{self.property}[{self.backend}-{self.mode}-{self.dtype}-{self.model}]"

    def passed(self, **details) -> E2EResult:
        self.outcome = "passed"
        self.details.update(details)
        return self

    def failed(self, message: str, **details) -> E2EResult:
        self.outcome, self.message = "failed", _first_line(message)
        self.details.update(details)
        return self

    def not_run(self, message: str) -> E2EResult:
        self.outcome, self.message = "not_run", message
        return self

    def partial(self, message: str, coverage: dict[str, str], /, **details) -> E2EResult:
        """Held, but not every coverage item was met (``coverage``: item → its state)."""
        self.outcome, self.message, self.coverage = "partial", message, dict(coverage)
        self.details.update(details)
        return self

    def not_meaningful(self, message: str) -> E2EResult:
        """Held, but only with no-op adapters: it proves the base model only (``message`` says which)."""
        self.outcome, self.message = "not_meaningful", message
        return self

    def to_record(self) -> dict:
        """The layer suite's report record (``moelora_conformance.report``): what the matrix, the
        manifest and ``moelora-conformance report`` read."""
        rec = asdict(self)
        rec.update(nodeid=f"e2e::{self.test}", test=self.test, reason=self.message if self.outcome != "failed" else "",
                   repro={"rerun": self.repro} if self.repro else None, phase="call")
        return rec


def _first_line(message: str) -> str:
    lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
    return lines[0][:500] if lines else "failed"


@contextmanager
def checking(result: E2EResult):
    """Run the block as ``result``'s check: an ``AssertionError`` (or any exception) fails it with its
    first line, a normal exit without a verdict passes it; the duration is recorded.

    Example::

        with checking(E2EResult("E01", backend, mode, "fp32", model)) as r:
            compare(...)                      # raises AssertionError on a mismatch
    """
    start = time.perf_counter()
    try:
        yield result
    except AssertionError as exc:
        result.failed(str(exc) or "assertion failed")
    except Exception as exc:  # a crash of the engine or the backend is a failure of the claim, named
        result.failed(f"{type(exc).__name__}: {exc}")
    else:
        if result.outcome == "not_run" and not result.message:
            result.passed()  # (a verdict the block gave — partial, not_run with its reason — is kept)
    finally:
        result.duration += time.perf_counter() - start
