"""The outcome words of a conformance record and what they mean for a run: which fail it, which are
not proven, its exit status, and the lines that list the claims not proven and not run (with their
coverage items and reasons). The report (:mod:`moelora_conformance.report`) renders them.

- ``passed``, ``failed``, ``xfailed`` / ``xpassed`` (a manifest entry's item failed / held: the latter
  is a stale entry and fails the run), ``not_run`` (with its reason), ``not_implemented``,
  ``not_applicable`` (DESIGN.md §7);
- **not proven** (:data:`NOT_PROVEN`): ``partial`` — the claim held but not every coverage item was met
  (the record's ``coverage``: item → "met" / "not met (...)" / "not applicable ...") — and
  ``not_meaningful`` — it held only with no-op adapters (``moelora_core.checkpoint.adapter_effect``).
  Not failures (exit 0) unless ``--require-coverage``; listed apart, each item met / not met.

Exit status (:func:`exit_status`): 1 an unexpected failure or a stale manifest entry (or, with
``require_coverage``, a claim not proven), 5 nothing executed, else 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

#: Every outcome word, in the order counts are shown.
OUTCOMES = ("passed", "failed", "xfailed", "xpassed", "partial", "not_meaningful", "not_run", "not_implemented",
            "not_applicable")
#: Outcomes of an item that executed (its call phase ran to a verdict).
EXECUTED = frozenset({"passed", "failed", "xfailed", "xpassed", "partial", "not_meaningful"})
#: Outcomes that fail a run.
UNEXPECTED = frozenset({"failed", "xpassed"})
#: Outcomes of claims that held but are not proven: a run fails on them only with ``--require-coverage``.
NOT_PROVEN = frozenset({"partial", "not_meaningful"})
#: An outcome as a matrix cell (and the lists below it) shows it.
SHORT = {"passed": "pass", "failed": "FAIL", "xfailed": "xfail", "xpassed": "XPASS", "not_run": "not run",
         "not_implemented": "n/i", "not_applicable": "–", "partial": "partial", "not_meaningful": "not meaningful"}


def summarize(records: Iterable[dict]) -> dict[str, int]:
    """Outcome → count (in :data:`OUTCOMES` order)."""
    counts = Counter(r["outcome"] for r in records)
    return {o: counts[o] for o in OUTCOMES if counts[o]}


def unexpected_failures(report: dict) -> list[dict]:
    """Records that fail the run: ``failed`` and ``xpassed`` (a stale manifest entry)."""
    return [r for r in report["records"] if r["outcome"] in UNEXPECTED]


def not_run(report: dict) -> list[dict]:
    """Records of items that were collected and never finished."""
    return [r for r in report["records"] if r["outcome"] == "not_run"]


def not_proven(report: dict) -> list[dict]:
    """Records of claims that held but are not proven (:data:`NOT_PROVEN`)."""
    return [r for r in report["records"] if r["outcome"] in NOT_PROVEN]


def exit_status(reports: Sequence[dict], *, require_coverage: bool = False) -> int:
    """The exit status of a run with these reports (the run's own, and ``moelora-conformance report``'s):
    1 an unexpected failure or a stale manifest entry (:data:`UNEXPECTED`), or — with ``require_coverage``
    — a claim not proven (:data:`NOT_PROVEN`); 5 nothing executed; else 0 (every failure expected by the
    manifest)."""
    records = [r for rep in reports for r in rep["records"]]
    if any(r["outcome"] in UNEXPECTED for r in records):
        return 1
    if require_coverage and any(r["outcome"] in NOT_PROVEN for r in records):
        return 1
    if not any(r["outcome"] in EXECUTED for r in records):
        return 5
    return 0


def _modes_of(records: Sequence[dict]) -> str:
    return ", ".join(dict.fromkeys(r["mode"] for r in records))


def _grouped(records: Sequence[dict], key) -> list[tuple[tuple, list[dict]]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return list(groups.items())


def coverage_text(coverage: dict[str, str], names: dict[str, str] | None = None) -> str:
    """A record's coverage items, not met first: ``not met: 64 ragged requests (16 requests); ... · met: base
    requests, ... · not applicable: ...``; ``names``: item id → its words in the claim (else the id)."""
    names = names or {}
    unmet = [f"{names.get(item, item)} {state.removeprefix('not met ')}".strip() for item, state in coverage.items()
             if state.startswith("not met")]
    met = [names.get(item, item) for item, state in coverage.items() if state == "met"]
    other = [f"{names.get(item, item)} ({state})" for item, state in coverage.items()
             if not state.startswith("not met") and state != "met"]
    parts = [f"not met: {'; '.join(unmet)}" if unmet else "", f"met: {', '.join(met)}" if met else "",
             f"not applicable: {'; '.join(other)}" if other else ""]
    return " · ".join(p for p in parts if p)


def not_proven_lines(report: dict) -> list[str]:
    """One line per not-proven claim of ``report`` (modes with the same verdict merged): the outcome and,
    for ``partial``, each coverage item met / not met; for ``not_meaningful``, why."""
    lines = []
    key = (lambda r: (r["property"], r["dtype"], r.get("model", ""), r["outcome"], r.get("reason") or r.get("message"),
                      tuple((r.get("coverage") or {}).items())))
    for (pid, dtype, model, outcome, reason, coverage), recs in _grouped(not_proven(report), key):
        where = f"{pid} [{_modes_of(recs)}; {dtype}{'; ' + model if model else ''}]"
        names = (recs[0].get("details") or {}).get("items")
        detail = coverage_text(dict(coverage), names) if coverage else reason
        lines.append(f"{where} {SHORT[outcome]}: {detail}")
    return lines


def not_run_lines(report: dict) -> list[str]:
    """One line per reason a claim did not run (items with the same reason merged), the reason first."""
    lines = []
    key = (lambda r: (r["property"], r.get("reason") or "did not finish (cut off: a time budget, an interrupt or a "
                                                        "crash)"))
    for (pid, reason), recs in _grouped(not_run(report), key):
        lines.append(f"{pid} [{_modes_of(recs)}] not run: {reason}")
    return lines


def summary_line(report: dict) -> str:
    """Outcome counts, and the not-proven claims by outcome (``... ; not proven: 4 (E05 partial × 4)``)."""
    counts = ", ".join(f"{n} {o}" for o, n in summarize(report["records"]).items())
    held = not_proven(report)
    if not held:
        return counts
    by = {}
    for r in held:
        by[(r["property"], r["outcome"])] = by.get((r["property"], r["outcome"]), 0) + 1
    return counts + f"; not proven: {len(held)} (" + ", ".join(
        f"{pid} {SHORT[o]} × {n}" for (pid, o), n in by.items()) + ")"
