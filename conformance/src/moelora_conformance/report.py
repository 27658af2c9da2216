"""Conformance results: the JSON report the plugin writes, and the support matrix
(backend × property × mode) rendered as Markdown or with rich.

The JSON report (``--report-json PATH``) holds a header — backend name, target, version,
capabilities, profile, device, every ``MOELORA_*`` variable, the manifest and its unmatched
entries, versions — and one record per property × mode × dtype:

    {"nodeid": ..., "test": "test_x[decode-fp16]", "property": "P05", "title": ..., "mode": "decode",
     "dtype": "fp16", "outcome": "passed" | "failed" | "error" | "xfailed" | "not implemented" |
     "skipped", "duration": seconds, "max_examples": the Hypothesis budget it ran with,
     "reason": skip / xfail reason, "message": first failure line, "repro": {...} or null}

"not implemented" is a skip for a capability the backend does not declare; it is shown apart from
failures. JUnit XML comes from pytest's own ``--junitxml``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from moelora_conformance.properties.registry import PROPERTIES
from moelora_conformance.strategies.suite import FAMILY_MODES, LAYER_MODES

OUTCOMES = ("passed", "failed", "error", "xfailed", "not implemented", "skipped")
#: Column order of the matrix.
MODE_ORDER = (*LAYER_MODES, *(m for m in FAMILY_MODES if m not in LAYER_MODES))
_SHORT = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "xfailed": "xfail", "not implemented": "n/i",
          "skipped": "skip"}
#: Severity for summarising a cell: the worst outcome wins.
_RANK = {"failed": 0, "error": 1, "xfailed": 2, "skipped": 3, "not implemented": 4, "passed": 5}


#: Prefix of the skip reason of an undeclared capability (the outcome "not implemented").
NOT_IMPLEMENTED = "not implemented"


def record_phase(records: dict[str, dict], *, nodeid: str, info: dict, when: str, passed: bool, failed: bool,
                 skipped: bool, duration: float, wasxfail: str | None, skip_reason: str, last_line: str) -> dict:
    """Fold one phase (setup / call / teardown) of a property item into its record.

    Args:
        records: nodeid → record, updated in place.
        info: the item's fields (property, title, mode, dtype, test, max_examples; on a failure also
            repro and message).
        when, passed, failed, skipped, duration, wasxfail: the phase's pytest report.
        skip_reason: the skip's reason (without "Skipped: "). last_line: of a failure's text.

    Returns:
        The record: outcome "passed" until a phase says otherwise — "xfailed" (an expected failure
        happened), "not implemented" (a skip for an undeclared capability), "skipped", "failed" (the
        call phase, including a strict xpass), "error" (setup or teardown).
    """
    rec = records.setdefault(nodeid, {"nodeid": nodeid, "outcome": "passed", "duration": 0.0, "reason": "",
                                      "message": "", "repro": None})
    rec.update({k: v for k, v in info.items() if k not in ("repro", "message")})
    rec["duration"] += duration
    if info.get("repro"):
        rec["repro"], rec["message"] = info["repro"], info.get("message", "")
    if wasxfail is not None:
        if skipped:
            rec["outcome"], rec["reason"] = "xfailed", wasxfail
        return rec
    if skipped:
        rec["outcome"] = "not implemented" if skip_reason.startswith(NOT_IMPLEMENTED) else "skipped"
        rec["reason"] = skip_reason
    elif failed:
        rec["outcome"] = "failed" if when == "call" else "error"
        rec["message"] = rec["message"] or last_line
    return rec


def load_report(path: str | Path) -> dict:
    """A JSON report written by the plugin.

    Raises:
        ValueError: not a moelora conformance report.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "records" not in data or "backend" not in data:
        raise ValueError(f"{path} is not a moelora conformance report (no 'backend' / 'records')")
    return data


def summarize(records: Iterable[dict]) -> dict[str, int]:
    """Outcome → count."""
    counts = Counter(r["outcome"] for r in records)
    return {o: counts[o] for o in OUTCOMES if counts[o]}


def unexpected_failures(report: dict) -> list[dict]:
    """Records that failed or errored (expected failures are 'xfailed')."""
    return [r for r in report["records"] if r["outcome"] in ("failed", "error")]


def cell(records: Sequence[dict]) -> str:
    """One matrix cell from the records of a property × mode (one per dtype): "pass" when every
    dtype passed, otherwise each dtype's outcome ("fp32 pass · fp16 FAIL"); "–" when empty."""
    if not records:
        return "–"
    shown = [_shown(r) for r in records]
    if len(set(shown)) == 1:
        return shown[0]
    parts = sorted(zip(records, shown), key=lambda rs: _RANK.get(rs[0]["outcome"], 9))
    return " · ".join(f"{r['dtype']} {text}" for r, text in parts)


def _shown(record: dict) -> str:
    """A record's outcome as a cell shows it; "FAIL (oracle)" where a property other than P01 failed
    because its batch did not match the oracle (the fault is P01's kind, not the property's own)."""
    text = _SHORT.get(record["outcome"], record["outcome"])
    if record["outcome"] == "failed" and record.get("check") == "oracle" and record.get("property") != "P01":
        text += " (oracle)"
    return text


def _grid(reports: Sequence[dict]) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """(mode columns, rows of (property id, backend, cells))."""
    modes_seen = {r["mode"] for rep in reports for r in rep["records"]}
    columns = [m for m in MODE_ORDER if m in modes_seen] + sorted(modes_seen - set(MODE_ORDER))
    rows = []
    for pid in sorted({r["property"] for rep in reports for r in rep["records"]}):
        for rep in reports:
            by_mode: dict[str, list[dict]] = defaultdict(list)
            for r in rep["records"]:
                if r["property"] == pid:
                    by_mode[r["mode"]].append(r)
            rows.append((pid, rep["backend"]["name"], [cell(by_mode.get(m, [])) for m in columns]))
    return columns, rows


def _title(pid: str) -> str:
    p = PROPERTIES.get(pid)
    return f"{pid} {p.title}" if p else pid


def _backend_line(rep: dict) -> str:
    b = rep["backend"]
    counts = ", ".join(f"{n} {o}" for o, n in summarize(rep["records"]).items())
    return (f"{b['name']} {b.get('version', '')} ({b.get('target', '')}) — profile {rep.get('profile')}, "
            f"device {rep.get('device')}, {rep.get('duration', 0):.0f} s: {counts}")


def matrix_markdown(reports: Sequence[dict]) -> str:
    """The support matrix as Markdown: one row per property × backend, one column per mode."""
    columns, rows = _grid(reports)
    multi = len(reports) > 1
    head = ["property", *(["backend"] if multi else []), *columns]
    lines = ["# moelora conformance: support matrix", ""]
    lines += [f"- {_backend_line(rep)}" for rep in reports]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pid, backend, cells in rows:
        lines.append("| " + " | ".join([_title(pid), *([backend] if multi else []), *cells]) + " |")
    lines += ["", "pass: every dtype passed · FAIL: an unexpected failure · FAIL (oracle): one of the property's "
              "batches failed the standard checks every run gets (oracle, base rows, pad rows: P01's kind of "
              "fault) before the property's own claim was checked · xfail: an expected "
              "failure (manifest) · n/i: not implemented (capability not declared) · –: not applicable", ""]
    for rep in reports:
        bad = unexpected_failures(rep)
        for r in bad:
            lines.append(f"- **{rep['backend']['name']} {r['test']}**: {r.get('message', '')}")
            repro = r.get("repro") or {}
            for key in ("replay", "rerun"):
                if repro.get(key):
                    lines.append(f"  - {key}: `{repro[key]}`")
        for entry in rep.get("manifest_unmatched", []):
            lines.append(f"- {rep['backend']['name']}: manifest entry matched nothing: {entry}")
    return "\n".join(lines).rstrip() + "\n"


def matrix_rich(reports: Sequence[dict], console=None) -> None:
    """Print the support matrix with rich (colours by outcome)."""
    from rich.console import Console
    from rich.table import Table

    # redirected output has no terminal width: rich would fold every title into an 80-column table
    console = console or Console(width=max(Console().width, 160))
    columns, rows = _grid(reports)
    multi = len(reports) > 1
    table = Table(title="moelora conformance: support matrix", show_lines=False)
    table.add_column("property", overflow="fold", max_width=48)
    if multi:
        table.add_column("backend")
    for c in columns:
        table.add_column(c, justify="center")
    style = {"pass": "green", "FAIL": "bold red", "ERROR": "bold red", "xfail": "yellow", "n/i": "dim", "–": "dim"}
    for pid, backend, cells in rows:
        styled = [f"[{style.get(c, 'red' if 'FAIL' in c or 'ERROR' in c else 'white')}]{c}[/]" for c in cells]
        table.add_row(_title(pid), *([backend] if multi else []), *styled)
    for rep in reports:
        console.print(_backend_line(rep))
    console.print(table)
    for rep in reports:
        for r in unexpected_failures(rep):
            console.print(f"[bold red]{rep['backend']['name']} {r['test']}[/]: {r.get('message', '')}")
            repro = r.get("repro") or {}
            for key in ("replay", "rerun"):
                if repro.get(key):
                    console.print(f"  {key}: {repro[key]}", soft_wrap=True)
        for entry in rep.get("manifest_unmatched", []):
            console.print(f"[yellow]{rep['backend']['name']}: manifest entry matched nothing: {entry}[/]")
