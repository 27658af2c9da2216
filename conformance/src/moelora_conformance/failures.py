"""What a failing property prints, and the run's log file.

A failing property item prints, in this order: the first line of each distinct failure, the moelora
repro (every example's trace — the case line with every slot — and one replay command per distinct
failure, then the rerun command), a one-line summary of Hypothesis' report, and the last frame of
the traceback. Hypothesis' full report (the falsifying example with every draw, the explanation,
the blob) and the captured output go to the run's log file, as do the warnings an item raised (the
Triton interpreter raises thousands per run), counted by kind: the terminal gets one line per item.
"""

from __future__ import annotations

import datetime as _dt
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from moelora_conformance.repro import Repro

#: Hypothesis hints that are false for the suite's profiles (``database=None``: nothing resumes).
_FALSE_HINTS = ("shrinking will resume",)


def first_line(exc: BaseException | None) -> str:
    """``Type: first line of the message`` (at most 400 characters)."""
    if exc is None:
        return ""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def check_lines(exc: BaseException, limit: int = 12) -> list[str]:
    """The failure's own message (what was compared, the errors, the first coordinates), without the
    notes Hypothesis attached."""
    return str(exc).strip().splitlines()[:limit]


@dataclass
class RunLog:
    """The run's log file: appended to by every process of the run (xdist workers too)."""

    path: Path

    def write(self, title: str, body: str) -> None:
        """Append one titled block."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().isoformat(timespec="seconds")
        with self.path.open("a", encoding="utf-8") as f:
            f.write(f"===== {stamp} pid {os.getpid()} {title}\n{body.rstrip()}\n\n")

    def warnings(self, nodeid: str, caught: list[warnings.WarningMessage]) -> str:
        """Log ``caught`` (counted per category, message and place) and return the terminal's line."""
        counts = Counter((w.category.__name__, str(w.message).splitlines()[0] if str(w.message) else "",
                          f"{w.filename}:{w.lineno}") for w in caught)
        body = "\n".join(f"{n:7d} x {cat}: {msg} ({where})" for (cat, msg, where), n in counts.most_common())
        self.write(f"warnings of {nodeid}", body)
        return f"{len(caught)} warnings ({len(counts)} kinds) silenced; they are in {self.path}"


def failure_text(repro: Repro, failures: list[BaseException], longrepr_tail: str, log: RunLog | None) -> str:
    """The text a failing property prints instead of pytest's long report (module docstring)."""
    lines = []
    for i, exc in enumerate(failures):
        head = f"failure {i + 1} of {len(failures)}: " if len(failures) > 1 else ""
        lines += [f"{head}{line}" if j == 0 else f"    {line}" for j, line in enumerate(check_lines(exc))]
    lines += ["", repro.text(), ""]
    where = f" (full report in {log.path})" if log is not None else ""
    lines.append(f"Hypothesis: {len(failures)} distinct failure{'s' if len(failures) != 1 else ''}, "
                 f"each shrunk and replayed{where}")
    tail = [t for t in longrepr_tail.strip().splitlines() if t.strip()]
    if tail:
        lines.append(f"raised at {tail[-1].strip()}")
    return "\n".join(lines)


def hypothesis_output(text: str) -> str:
    """Hypothesis' captured output without the hints that are false for the suite's profiles."""
    return "\n".join(line for line in text.splitlines() if not any(h in line for h in _FALSE_HINTS))
