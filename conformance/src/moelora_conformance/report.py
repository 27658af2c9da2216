"""Conformance results: the JSON report the plugin writes, and the support matrix
(backend × property × mode) rendered as Markdown or with rich.

The JSON report (``--report-json PATH``) holds a header — backend name, target, version, the file
and distribution it was imported from, capabilities, profile, device, every ``MOELORA_*`` variable
and ``TRITON_INTERPRET``, the manifest and its unmatched entries, versions — and one record per
collected property × mode × dtype:

    {"nodeid": ..., "test": "test_x[decode-fp16]", "property": "P05", "title": ..., "mode": "decode",
     "dtype": "fp16", "outcome": one of OUTCOMES, "phase": where it ended, "duration": seconds,
     "max_examples": the Hypothesis budget it ran with, "reason": skip / xfail reason,
     "message": first failure line, "repro": {...} or null}

Outcomes (:data:`OUTCOMES`, fixed; DESIGN.md §7):

- ``passed``: the item ran to the end and every check held;
- ``failed``: a check failed, or setup / teardown raised, or the process running it crashed;
- ``xfailed`` / ``xpassed``: a manifest entry's item failed as expected / passed (strict: the run fails);
- ``partial``: the claim held, but not every one of its coverage items was met (the record's
  ``coverage``: item → "met" / "not met (...)" / "not applicable ..."; the e2e suite's E05);
- ``not_meaningful``: the claim held, but relied only on no-op adapters, so it proves the base model
  only (the record's ``reason`` names them);
- ``not_run``: collected but never finished — cut off by a time budget, an interrupt or a timeout,
  or skipped for a reason other than a capability (e.g. a missing optional package); its ``reason``
  says why wherever one is known;
- ``not_implemented``: skipped because the backend does not declare the capability;
- ``not_applicable``: a matrix cell for a mode the property does not have (no record is written).

An item starts as ``not_run`` when it is collected and becomes ``passed`` only when its call phase
passed: nothing that did not finish is ever reported as passed. JUnit XML comes from pytest's own
``--junitxml``.

``partial`` and ``not_meaningful`` are *not proven*: not failures (a run with them exits 0), but listed
apart — under "Not proven" in the matrix and in the summary line, each coverage item met or not met —
and, with ``--require-coverage``, they fail the run (exit 1; :func:`exit_status`). The outcome words, the
exit status and the not proven / not run lists are :mod:`moelora_conformance.outcomes` (re-exported here).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from moelora_conformance.e2e.properties import E2E_PROPERTIES
from moelora_conformance.e2e.results import E2E_MODES, MIXED_MODE
from moelora_conformance.outcomes import (  # noqa: F401 (re-exported: the report's outcome words)
    EXECUTED,
    NOT_PROVEN,
    OUTCOMES,
    SHORT,
    UNEXPECTED,
    coverage_text,
    exit_status,
    not_proven,
    not_proven_lines,
    not_run,
    not_run_lines,
    summarize,
    summary_line,
    unexpected_failures,
)
from moelora_conformance.properties.registry import PROPERTIES as LAYER_PROPERTIES
from moelora_conformance.strategies.suite import FAMILY_MODES, LAYER_MODES

#: Every property a report can hold: the layer suite's P01.. and the e2e suite's E01.. (one matrix
#: renders either).
PROPERTIES = {**LAYER_PROPERTIES, **E2E_PROPERTIES}

#: Words of reports written before the outcomes were fixed → today's word.
_LEGACY = {"not implemented": "not_implemented", "error": "failed", "skipped": "not_run"}
#: Column order of the matrix.
MODE_ORDER = (*LAYER_MODES, *(m for m in FAMILY_MODES if m not in LAYER_MODES),
              *(m for m in (*E2E_MODES, MIXED_MODE) if m not in LAYER_MODES))
#: Severity for summarising a cell: the worst outcome wins.
_RANK = {"failed": 0, "xpassed": 1, "not_run": 2, "not_meaningful": 3, "partial": 4, "xfailed": 5,
         "not_implemented": 6, "passed": 7, "not_applicable": 8}


#: Prefix of the skip reason of an undeclared capability (the outcome "not_implemented").
NOT_IMPLEMENTED = "not implemented"
#: Prefix of the skip reason of an item that cannot run here for another reason (outcome "not_run").
NOT_RUN = "not run"


def new_record(nodeid: str, info: dict) -> dict:
    """The record of a collected item before it ran: outcome ``not_run``."""
    rec = {"nodeid": nodeid, "outcome": "not_run", "phase": "collected", "duration": 0.0, "reason": "",
           "message": "", "repro": None}
    rec.update({k: v for k, v in info.items() if k not in ("repro", "message")})
    return rec


def record_phase(records: dict[str, dict], *, nodeid: str, info: dict, when: str, passed: bool, failed: bool,
                 skipped: bool, duration: float, wasxfail: str | None, skip_reason: str, last_line: str) -> dict:
    """Fold one phase (setup / call / teardown, or xdist's crash report) of a property item into its
    record.

    Args:
        records: nodeid → record, updated in place (an unknown nodeid gets a fresh ``not_run`` record).
        info: the item's fields (property, title, mode, dtype, test, max_examples; on a failure also
            repro and message); may be empty (a crash report carries none).
        when, passed, failed, skipped, duration, wasxfail: the phase's pytest report.
        skip_reason: the skip's reason (without "Skipped: "). last_line: of a failure's text.

    Returns:
        The record: ``not_run`` until a phase decides — ``passed`` only when the call phase passed
        (a non-strict XPASS: ``xpassed``); ``xfailed`` (an expected failure happened); ``xpassed``
        (a strict XPASS); ``not_implemented`` / ``not_run`` (a skip for an undeclared capability /
        for another reason); ``failed`` (any phase failed; a later pass never undoes it).
    """
    rec = records.get(nodeid)
    if rec is None:
        rec = records[nodeid] = new_record(nodeid, info)
    rec.update({k: v for k, v in info.items() if k not in ("repro", "message")})
    rec["duration"] += duration
    if info.get("repro"):
        rec["repro"], rec["message"] = info["repro"], info.get("message", "")
    if rec["outcome"] == "failed":
        return rec  # a failed setup or call stays failed whatever teardown does
    if wasxfail is not None:
        if skipped:
            rec["outcome"], rec["reason"], rec["phase"] = "xfailed", wasxfail, when
        elif passed and when == "call":
            rec["outcome"], rec["reason"], rec["phase"] = "xpassed", wasxfail, when
        return rec
    if skipped:
        rec["outcome"] = "not_implemented" if skip_reason.startswith(NOT_IMPLEMENTED) else "not_run"
        rec["reason"], rec["phase"] = skip_reason, when
    elif failed:
        strict_xpass = last_line.startswith("[XPASS(strict)]")
        rec["outcome"] = "xpassed" if strict_xpass else "failed"
        rec["phase"] = when
        rec["message"] = rec["message"] or last_line
    elif passed and when == "call":
        rec["outcome"], rec["phase"] = "passed", when
    return rec


def load_report(path: str | Path) -> dict:
    """A JSON report written by the plugin, its outcomes in today's words (:data:`OUTCOMES`; a report
    of an older version said "not implemented", "error", "skipped").

    Raises:
        ValueError: not a moelora conformance report.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "records" not in data or "backend" not in data:
        raise ValueError(f"{path} is not a moelora conformance report (no 'backend' / 'records')")
    for r in data["records"]:
        r["outcome"] = _LEGACY.get(r["outcome"], r["outcome"])
    return data


def applicable(pid: str, mode: str) -> bool:
    """Whether property ``pid`` has ``mode`` (unknown properties: assume so)."""
    p = PROPERTIES.get(pid)
    return p is None or mode in p.modes


def cell(records: Sequence[dict], *, is_applicable: bool = True) -> str:
    """One matrix cell from the records of a property × mode (one per dtype): "pass" when every
    dtype passed, otherwise each dtype's outcome ("fp32 pass · fp16 FAIL"). Without records: "–"
    (``not_applicable``) where the property has no such mode, "not run" where it has."""
    if not records:
        return SHORT["not_run"] if is_applicable else SHORT["not_applicable"]
    shown = [_shown(r) for r in records]
    if len(set(shown)) == 1:
        return shown[0]
    parts = sorted(zip(records, shown), key=lambda rs: _RANK.get(rs[0]["outcome"], 9))
    return " · ".join(f"{r['dtype']} {text}" for r, text in parts)


def _shown(record: dict) -> str:
    """A record's outcome as a cell shows it; "FAIL (oracle)" where a property other than P01 failed
    because its batch did not match the oracle (the fault is P01's kind, not the property's own)."""
    text = SHORT.get(record["outcome"], record["outcome"])
    if record["outcome"] == "failed" and record.get("check") == "oracle" and record.get("property") != "P01":
        text += " (oracle)"
    return text


#: Which of two records of one item a merged report keeps: the more decisive one.
_MERGE_RANK = {"failed": 0, "xpassed": 1, "passed": 2, "xfailed": 2, "partial": 2, "not_meaningful": 2,
               "not_implemented": 3, "not_run": 4}


def merge_reports(reports: Sequence[dict]) -> list[dict]:
    """Reports of the same backend (name and target) merged into one, in first-seen order: split runs
    of one backend (``-k`` selections, shards, a run resumed after a time budget) give one matrix row.
    Per item the more decisive record wins (a failure over a pass, anything that ran over ``not_run``);
    durations add up; unmatched manifest entries are kept once."""
    merged: dict[tuple[str, str], dict] = {}
    for rep in reports:
        key = (rep["backend"]["name"], rep["backend"].get("target", ""))
        if key not in merged:
            merged[key] = {**rep, "records": list(rep["records"]),
                           "manifest_unmatched": list(rep.get("manifest_unmatched", []))}
            continue
        into = merged[key]
        by_id = {r["nodeid"]: i for i, r in enumerate(into["records"]) if "nodeid" in r}
        for r in rep["records"]:
            i = by_id.get(r.get("nodeid"))
            if i is None:
                into["records"].append(r)
            elif _MERGE_RANK.get(r["outcome"], 9) < _MERGE_RANK.get(into["records"][i]["outcome"], 9):
                into["records"][i] = r
        into["duration"] = into.get("duration", 0) + rep.get("duration", 0)
        into["manifest_unmatched"] += [e for e in rep.get("manifest_unmatched", [])
                                       if e not in into["manifest_unmatched"]]
        into["runs"] = into.get("runs", 1) + 1
    return list(merged.values())


def _selected_modes(rep: dict) -> set[str] | None:
    """The modes an e2e run was asked for (``--modes``; its state machine's "mixed" too), or None (every mode:
    the layer suite, whose unselected items a split run may still cover)."""
    modes = (rep.get("config") or {}).get("modes") if rep.get("suite") == "e2e" else None
    return None if modes is None else {*modes, MIXED_MODE}


def _grid(reports: Sequence[dict]) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """(mode columns, rows of (property id, backend, cells)) over the merged reports."""
    modes_seen = {r["mode"] for rep in reports for r in rep["records"]}
    # every mode of the properties present: a mode that never ran shows as "not run", not as absent (an e2e
    # run's modes that were not asked for are left out)
    modes_seen |= {m for rep in reports for r in rep["records"] if r["property"] in PROPERTIES
                   for m in PROPERTIES[r["property"]].modes
                   if _selected_modes(rep) is None or m in _selected_modes(rep)}
    columns = [m for m in MODE_ORDER if m in modes_seen] + sorted(modes_seen - set(MODE_ORDER))
    rows = []
    for pid in sorted({r["property"] for rep in reports for r in rep["records"]}):
        for rep in reports:
            by_mode: dict[str, list[dict]] = defaultdict(list)
            for r in rep["records"]:
                if r["property"] == pid:
                    by_mode[r["mode"]].append(r)
            cells = [cell(by_mode.get(m, []), is_applicable=applicable(pid, m)) for m in columns]
            rows.append((pid, rep["backend"]["name"], cells))
    return columns, rows


def _title(pid: str) -> str:
    p = PROPERTIES.get(pid)
    return f"{pid} {p.title}" if p else pid


def _backend_line(rep: dict) -> str:
    b = rep["backend"]
    runs = f", {rep['runs']} runs merged" if rep.get("runs", 1) > 1 else ""
    return (f"{b['name']} {b.get('version', '')} ({b.get('target', '')}) — profile {rep.get('profile')}, "
            f"device {rep.get('device')}, {rep.get('duration', 0):.0f} s{runs}: {summary_line(rep)}")


LEGEND = ("pass: every dtype passed · FAIL: an unexpected failure · FAIL (oracle): one of the property's batches "
          "failed the standard checks every run gets (oracle, base rows, pad rows: P01's kind of fault) before the "
          "property's own claim was checked · xfail: an expected failure (manifest) · XPASS: a manifest entry that "
          "passed (stale) · partial: held, but not every coverage item was met (not proven: listed below, each item "
          "met / not met) · not meaningful: held only with no-op adapters, so it proves the base model only (not "
          "proven) · not run: collected but never finished (time budget, interrupt, crash) or not started "
          "(a missing optional package, a split run that did not select it, nothing exercised it), with its reason "
          "below · n/i: not implemented (capability not declared) · –: not applicable (the property has no such "
          "mode)")


def _suite_name(reports: Sequence[dict]) -> str:
    """"conformance" (the layer suite) or "e2e" (reports whose ``suite`` says so)."""
    return "e2e" if reports and all(rep.get("suite") == "e2e" for rep in reports) else "conformance"


def matrix_markdown(reports: Sequence[dict]) -> str:
    """The support matrix as Markdown: one row per property × backend (split runs of one backend
    merged), one column per mode."""
    reports = merge_reports(reports)
    columns, rows = _grid(reports)
    multi = len(reports) > 1
    head = ["property", *(["backend"] if multi else []), *columns]
    lines = [f"# moelora {_suite_name(reports)}: support matrix", ""]
    lines += [f"- {_backend_line(rep)}" for rep in reports]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pid, backend, cells in rows:
        lines.append("| " + " | ".join([_title(pid), *([backend] if multi else []), *cells]) + " |")
    lines += ["", LEGEND, ""]
    for rep in reports:
        bad = unexpected_failures(rep)
        for r in bad:
            lines.append(f"- **{rep['backend']['name']} {r['test']}**: {r.get('message', '')}")
            lines += [f"  - {key}: `{cmd}`" for key, cmd in repro_lines(r)]
        for entry in rep.get("manifest_unmatched", []):
            lines.append(f"- {rep['backend']['name']}: manifest entry matched nothing: {entry}")
    for title, of in (("Not proven", not_proven_lines), ("Not run", not_run_lines)):
        found = [(rep, line) for rep in reports for line in of(rep)]
        if found:
            lines += ["", f"## {title}", ""]
            lines += [f"- {rep['backend']['name']} {line}" if multi else f"- {line}" for rep, line in found]
    warned = [w for rep in reports for w in rep.get("adapter_warnings", [])]
    if warned:
        lines += ["", "## Adapter warnings", "", *(f"- {w}" for w in dict.fromkeys(warned))]
    return "\n".join(lines).rstrip() + "\n"


def repro_lines(record: dict) -> list[tuple[str, str]]:
    """(label, command) of a failed record's repro: one replay line per distinct failure, then the
    rerun line."""
    repro = record.get("repro") or {}
    replays = repro.get("replays") or ([repro["replay"]] if repro.get("replay") else [])
    out = [(f"replay failure {i + 1}" if len(replays) > 1 else "replay", cmd) for i, cmd in enumerate(replays)]
    if repro.get("rerun"):
        out.append(("rerun", repro["rerun"]))
    return out


def matrix_rich(reports: Sequence[dict], console=None) -> None:
    """Print the support matrix with rich (colours by outcome)."""
    from rich.console import Console
    from rich.table import Table

    # redirected output has no terminal width: rich would fold every title into an 80-column table
    console = console or Console(width=max(Console().width, 160))
    reports = merge_reports(reports)
    columns, rows = _grid(reports)
    multi = len(reports) > 1
    table = Table(title=f"moelora {_suite_name(reports)}: support matrix", show_lines=False)
    table.add_column("property", overflow="fold", max_width=48)
    if multi:
        table.add_column("backend")
    for c in columns:
        table.add_column(c, justify="center")
    style = {"pass": "green", "FAIL": "bold red", "XPASS": "bold red", "xfail": "yellow", "not run": "bold yellow",
             "n/i": "dim", "–": "dim", "partial": "yellow", "not meaningful": "yellow"}
    for pid, backend, cells in rows:
        styled = [f"[{style.get(c, 'red' if 'FAIL' in c or 'XPASS' in c else 'white')}]{c}[/]" for c in cells]
        table.add_row(_title(pid), *([backend] if multi else []), *styled)
    for rep in reports:
        console.print(_backend_line(rep))
    console.print(table)
    for rep in reports:
        for r in unexpected_failures(rep):
            console.print(f"[bold red]{rep['backend']['name']} {r['test']}[/]: {r.get('message', '')}")
            for key, cmd in repro_lines(r):
                console.print(f"  {key}: {cmd}", soft_wrap=True)
        for title, of in (("not proven", not_proven_lines), ("not run", not_run_lines)):
            for line in of(rep):
                console.print(f"[yellow]{rep['backend']['name']} {title}:[/] {line}", soft_wrap=True, highlight=False)
        for entry in rep.get("manifest_unmatched", []):
            console.print(f"[yellow]{rep['backend']['name']}: manifest entry matched nothing: {entry}[/]")
