"""Run the conformance suite on one backend in a subprocess and read its JSON report.

Used by ``moelora-conformance run`` (``nox -s conformance``), by the mutation campaign and by the
suite's own tests. A subprocess keeps each run's Hypothesis settings, imported backends and torch
state apart, exactly as a user's one-line command would have them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moelora_conformance.report import load_report


@dataclass(frozen=True)
class SuiteRun:
    """The outcome of one suite run.

    Attributes:
        backend: the ``--backend`` target. returncode: pytest's exit status.
        report: the parsed JSON report (None if pytest wrote none, e.g. a usage error).
        seconds: wall time of the subprocess. output: its combined stdout and stderr.
        command: the argv that ran.
    """

    backend: str
    returncode: int
    report: dict | None
    seconds: float
    output: str
    command: tuple[str, ...]


def suite_command(backend: str, *, profile: str, report_json: str | Path, device: str = "cpu",
                  manifest: str | Path | None = None, junitxml: str | Path | None = None,
                  max_examples: int | None = None, no_shrink: bool = False, exitfirst: bool = False,
                  hypothesis_seed: int | None = None, workers: int | None = None,
                  extra: Sequence[str] = ()) -> list[str]:
    """The argv of one suite run (``python -m pytest -p moelora_conformance.plugin ...``)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "moelora_conformance.plugin", "-p", "no:cacheprovider",
           "--backend", backend, "--profile", profile, "--device", device, "--report-json", str(report_json),
           "-q", "-rN"]
    if manifest:
        cmd += ["--manifest", str(manifest)]
    if junitxml:
        cmd += [f"--junitxml={junitxml}"]
    if max_examples is not None:
        cmd += ["--max-examples", str(max_examples)]
    if no_shrink:
        cmd.append("--no-shrink")
    if exitfirst:
        cmd.append("-x")
    if hypothesis_seed is not None:
        cmd.append(f"--hypothesis-seed={hypothesis_seed}")
    if workers:
        cmd += ["-n", str(workers)]
    return [*cmd, *extra]


def run_suite(backend: str, *, profile: str, report_json: str | Path | None = None, cwd: str | Path | None = None,
              env: dict[str, str] | None = None, timeout: float | None = None, **kwargs) -> SuiteRun:
    """Run the suite on ``backend`` in a subprocess (arguments as :func:`suite_command`).

    ``TRITON_INTERPRET=1`` is set for CPU runs unless the caller's environment says otherwise
    (Triton reads it at import). ``report_json`` defaults to a temporary file.

    Raises:
        subprocess.TimeoutExpired: the run took longer than ``timeout`` seconds.
    """
    full_env = {**os.environ, **(env or {})}
    if kwargs.get("device", "cpu") == "cpu":
        full_env.setdefault("TRITON_INTERPRET", "1")
    with tempfile.TemporaryDirectory(prefix="moelora-suite-") as tmp:
        path = Path(report_json) if report_json else Path(tmp) / "report.json"
        cmd = suite_command(backend, profile=profile, report_json=path, **kwargs)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd or tmp, env=full_env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - start
        report = load_report(path) if path.is_file() else None
    return SuiteRun(backend, proc.returncode, report, seconds, proc.stdout + proc.stderr, tuple(cmd))
