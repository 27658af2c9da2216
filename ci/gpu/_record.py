"""What the GPU scripts of ``ci/gpu`` share: the environment they run pytest in (source folders on
``PYTHONPATH``, real kernels), the environment record every report starts with (date, GPU,
versions), and the counts read back from pytest's and Hypothesis' output.

Imported by the scripts beside it (``python ci/gpu/<script>.py`` puts this folder first on
``sys.path``); needs only the standard library until :func:`environment` imports torch.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

#: The repository root (the scripts run pytest from here or name paths under it).
ROOT = Path(__file__).resolve().parents[2]


def source_env(sources: Sequence[str]) -> dict[str, str]:
    """``os.environ`` for a pytest run from source: ``sources`` (folders under :data:`ROOT`) first on
    ``PYTHONPATH``, and no ``TRITON_INTERPRET`` (real kernels, not the interpreter)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / p) for p in sources] + [env.get("PYTHONPATH", "")])
    return env


def environment() -> dict[str, str]:
    """The run's environment: ``date`` (UTC, ISO 8601 to the second), ``gpu`` (device 0's name, or
    "none"), ``torch``, ``cuda``, ``triton`` ("not installed" without it) and ``python`` versions."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton_version,
        "python": platform.python_version(),
    }


def environment_line(env: dict[str, str] | None = None) -> str:
    """:func:`environment` as one line for a text report."""
    env = env or environment()
    return (f"date {env['date'][:10]} | {env['gpu']} | torch {env['torch']} (CUDA {env['cuda']}) | "
            f"triton {env['triton']} | python {env['python']}")


def pytest_summary(output: str) -> dict[str, int]:
    """Counts of pytest's last output line (``3 passed, 1 skipped in 2.0s`` → passed / skipped)."""
    last = output.splitlines()[-1] if output.strip() else ""
    return {what: int(n) for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last)}


def hypothesis_examples(output: str) -> dict[str, dict[str, int]]:
    """Hypothesis' per-test statistics (``--hypothesis-show-statistics``): test id → passing /
    failing / invalid examples."""
    examples, current = {}, None
    for line in output.splitlines():
        m = re.match(r"^(\S+::\S+):$", line.strip())
        if m:
            current = m.group(1)
            continue
        m = re.search(r"- (\d+) passing, (\d+) failing, and (\d+) invalid", line)
        if m and current:
            examples[current] = {"passing": int(m.group(1)), "failing": int(m.group(2)), "invalid": int(m.group(3))}
    return examples


def run_timed(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], note: str = "",
              log: Path | None = None, budget_s: float | None = None,
              echo: bool = False) -> tuple[subprocess.CompletedProcess, float, str]:
    """Print and run ``cmd``, streaming its output line by line to ``log`` (flushed, so a run cut
    short by the device's call limit still leaves what it printed) and keeping it for the caller.

    ``budget_s``: after that many seconds the command gets SIGINT (pytest then stops at the current
    test and still writes its JUnit / JSON reports), and SIGKILL 60 s later. ``echo``: also print each
    line the moment it arrives (a caller whose own stdout is the log, as a GPU matrix cell's is).
    A SIGINT to this process (the matrix's cell timeout interrupts the whole process group) does not
    stop the reading: the command got it too, and what it prints while it stops is kept.

    Returns:
        (the finished process, with ``stdout`` = the whole output; wall seconds; the output).
    """
    print("running:", " ".join(cmd), note, flush=True)
    start = time.time()
    lines: list[str] = []
    sink = open(log, "w") if log else None
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def _interrupt() -> None:
        proc.send_signal(signal.SIGINT)
        threading.Timer(60, proc.kill).start()

    timer = threading.Timer(budget_s, _interrupt) if budget_s else None
    if timer:
        timer.daemon = True
        timer.start()
    def _pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if echo:
                print(line, end="", flush=True)
            if sink:
                sink.write(line)
                sink.flush()

    try:
        try:
            _pump()
        except KeyboardInterrupt:
            _pump()  # the rest: the command's summary as it stops (a second SIGINT ends this too)
        proc.wait()
    finally:
        if timer:
            timer.cancel()
        if sink:
            sink.close()
    output = "".join(lines)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, output, ""), time.time() - start, output


def write_record(path: Path | str, record: dict) -> None:
    """Write a run's record as indented JSON."""
    Path(path).write_text(json.dumps(record, indent=2))
