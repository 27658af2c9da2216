"""The GPU CI matrix runner: the cells of ``ci/matrix.toml``, each in its own process, resumable,
stopped cleanly at a time budget, and one report over any number of runs (DESIGN.md §9).

    python3 ci/gpu/matrix.py list [--select EXPR]
    python3 ci/gpu/matrix.py run [--select EXPR] [--budget-s N] [--resume DIR ...] [--jobs N] --out-dir DIR
                                  [--commit SHA]
    python3 ci/gpu/matrix.py report DIR_OR_FILE ... [--markdown out.md] [--json out.json]

``--select`` (repeatable; a cell is selected when any one matches): comma-separated terms that must
all hold, ``axis=glob`` (``suite=conformance,backend=triton,dtype=bf16``) or a glob on the cell id
(``conformance/triton/*``). A group's ``parts`` table splits a cell into several of one call each
(the kernel suite by test file): cell ids then end in ``:part``.

``run`` appends one JSON line per finished cell to ``DIR/records.jsonl`` the moment the cell ends (a
call killed by the device's limit keeps every finished cell) and the cells' output to
``DIR/matrix.log``; two files, because the GPU device returns at most eight. Cells already recorded
as finished in ``--resume`` records (or in ``DIR`` itself) are skipped, unless the record was made
under another definition of the cell (its tests, ``-k`` or options changed since:
``Cell.definition``). Before a cell starts, the runner checks that its estimate fits what is left of
``--budget-s``; if it does not, the run stops there and the remaining cells stay unrecorded (the
next run resumes them). A cell runs with a
timeout (``timeout_s``, default 1.5 × its estimate) and the environment of a GPU host running from
source: the packages' ``src`` folders on ``PYTHONPATH``, no ``TRITON_INTERPRET`` (real kernels, real
CUDA graphs). Sync debug mode "error": every suite runs its prepare + forward (and the kernel suite
every launch) inside ``moelora_core.graphs.host_sync_guard``, which on CUDA is
``torch.cuda.set_sync_debug_mode("error")``; test code outside the guard may read results on the host.

``--jobs N`` runs up to N cells at once on the one GPU (the conformance and e2e cells are small
shapes, bound by the host's Python and compiles, not the GPU), each with ``OMP_NUM_THREADS`` set to
its share of the cores; a cell with ``exclusive = true`` (the benchmarks) runs alone.

``report`` merges records (the newest record of a cell wins) and lists every cell of the matrix —
a cell without a record is "not run" — with its status, max error against its tolerance where the
suite reports one, examples run, seconds, versions and commit, as Markdown and JSON.

Statuses: ``pass``; ``fail`` (the suite ran and something failed); ``error`` (the cell's process
could not run its suite: exit 2-4, a crash); ``timeout`` (its own timeout fired); ``nothing-ran``
(exit 5: no test ran, never a pass); ``incomplete`` (exit 0, but the suite's report says a
property of the cell did not run, e.g. no tolerance row for its dtype: never a pass); ``cut`` (the
run's budget, shorter than the cell's own timeout, stopped it: recorded for its log, but not
finished, so ``--resume`` runs it again); ``not-run`` (no record).

Only the standard library is needed to list, select, run and report (Python 3.11+: ``tomllib``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import fnmatch
import hashlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "ci" / "matrix.toml"
SOURCES = ["packages/core/src", "packages/kernels/src", "packages/backends/src", "packages/runner/src",
           "reference/src", "conformance/src"]
AXES = ("suite", "backend", "mode", "dtype", "family", "profile")
SUITES = ("kernels", "graphs", "conformance", "peers", "engine", "checkpoint-pass", "e2e", "benchmarks")
#: The peers' files and their small libraries on the GPU host: the folder built on a CPU machine by
#: packages/peers/scripts/build_gpu_folder.py and carried (its wheels installed into ``site``).
PEERS_FOLDER = ".gpu/peers"
#: The Hypothesis seed of the peers grid (CPU and GPU cells draw the same cases).
PEERS_SEED = 20261206
FINISHED = ("pass", "incomplete", "fail", "error", "timeout", "nothing-ran")
#: Longest timeout of one cell: the device's 10-minute call less its start-up.
MAX_TIMEOUT_S = 570
RECORDS = "records.jsonl"
#: Cell options that change when or beside what a cell runs, not what it runs.
SCHEDULING = ("exclusive",)
LOG = "matrix.log"


class MatrixError(ValueError):
    """ci/matrix.toml (or a --select expression) is malformed; the message names the entry."""


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix.

    Attributes:
        axes: axis → value ("-" where it does not apply), in :data:`AXES` order.
        estimate_s: measured wall time on the GPU host. timeout_s: when the runner kills it.
        options: the group's other keys (``max_examples``, ...), passed to the suite's command.
        target, manifest: the backend's ``module:factory`` (or built-in name) and manifest path.
    """

    axes: dict[str, str]
    estimate_s: float
    timeout_s: float
    options: dict[str, object] = field(default_factory=dict)
    target: str = ""
    manifest: str = ""
    part: str = ""
    tests: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        base = "/".join(self.axes[a] for a in AXES)
        return f"{base}:{self.part}" if self.part else base

    @property
    def definition(self) -> str:
        """A digest of what the cell runs (its backend target, manifest, test files and options;
        not its estimate or scheduling): a record made under another definition of the same id is
        stale (:func:`is_current`)."""
        what = {"target": self.target, "manifest": self.manifest, "tests": list(self.tests),
                "options": {k: v for k, v in sorted(self.options.items()) if k not in SCHEDULING}}
        return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _as_list(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def load_matrix(path: Path | str = MATRIX) -> list[Cell]:
    """Every cell of the matrix file, in file order.

    Raises:
        MatrixError: an unknown suite or axis key, a group without ``estimate_s``, a backend name
            not in ``[backends]``, two cells with one id.
    """
    data = tomllib.loads(Path(path).read_text())
    backends = data.get("backends", {})
    cells: list[Cell] = []
    for n, group in enumerate(data.get("group", []), 1):
        where = f"{Path(path).name} group {n}"
        if "estimate_s" not in group:
            raise MatrixError(f"{where}: needs estimate_s (seconds measured on the GPU host)")
        suites = _as_list(group.get("suite", "-"))
        for s in suites:
            if s not in SUITES:
                raise MatrixError(f"{where}: unknown suite {s!r}; expected one of {SUITES}")
        options = {k: v for k, v in group.items() if k not in (*AXES, "estimate_s", "timeout_s", "parts")}
        values = [_as_list(group.get(a, "-")) for a in AXES]
        parts = group.get("parts", {"": {}})
        if not isinstance(parts, dict) or not all(isinstance(v, dict) for v in parts.values()):
            raise MatrixError(f"{where}: parts must be a table of tables (name = {{ tests = [...], estimate_s = N }})")
        for combo in itertools.product(*values):
            axes = dict(zip(AXES, combo))
            b = axes["backend"]
            if b != "-" and b not in backends:
                raise MatrixError(f"{where}: backend {b!r} is not declared in [backends] ({sorted(backends)})")
            for part, spec in parts.items():
                estimate = float(spec.get("estimate_s", group["estimate_s"]))
                timeout = float(spec.get("timeout_s", group.get("timeout_s", min(MAX_TIMEOUT_S, 1.5 * estimate))))
                entry = backends.get(b, {})
                own = {**options, **{k: v for k, v in spec.items() if k not in ("tests", "estimate_s", "timeout_s")}}
                cells.append(Cell(axes, estimate, timeout, own, entry.get("target", b), entry.get("manifest", ""),
                                  part, tuple(_as_list(spec.get("tests", [])))))
    ids = [c.id for c in cells]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise MatrixError(f"{Path(path).name}: cells with the same id: {dupes}")
    return cells


def _term_holds(cell: Cell, term: str) -> bool:
    if "=" in term:
        axis, _, pattern = term.partition("=")
        axis = axis.strip()
        if axis not in AXES:
            raise MatrixError(f"--select: unknown axis {axis!r} in {term!r}; axes are {AXES}")
        return fnmatch.fnmatchcase(cell.axes[axis], pattern.strip())
    return fnmatch.fnmatchcase(cell.id, term.strip())


def select(cells: Iterable[Cell], expressions: Sequence[str] | None) -> list[Cell]:
    """The cells matching any of ``expressions`` (all cells when there are none); see the module doc.

    Raises:
        MatrixError: an unknown axis in an expression.
    """
    cells = list(cells)
    if not expressions:
        return cells
    return [c for c in cells
            if any(all(_term_holds(c, t) for t in expr.split(",") if t.strip()) for expr in expressions)]


# --- records -------------------------------------------------------------------------------------


def read_records(paths: Iterable[Path | str]) -> dict[str, dict]:
    """cell id → its newest record, from ``records.jsonl`` files or folders holding ``*.jsonl``.
    Records of a cell the run did not finish (status ``not-run``) are ignored."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
    out: dict[str, dict] = {}
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("status") not in FINISHED or out_of_memory_beside_others(rec):
                continue
            prev = out.get(rec["cell"])
            if prev is None or rec.get("finished", "") >= prev.get("finished", ""):
                out[rec["cell"]] = rec
    return out


def out_of_memory_beside_others(record: dict) -> bool:
    """Whether ``record`` is of a cell that ran out of GPU memory while other cells shared the GPU
    (``jobs`` > 1): not a finding about the code, so it counts as not run (``--resume`` runs the
    cell again; run such a cell with ``--jobs 1``, where running out of memory is a finding)."""
    if int(record.get("jobs") or 1) <= 1 or record.get("status") == "pass":
        return False
    text = " ".join(map(str, record.get("failures") or [])) + " " + str(record.get("message") or "")
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


def _versions() -> dict[str, str]:
    """torch / CUDA / triton versions and the GPU's name, from a child process (the runner itself
    imports no torch); "unknown" where they cannot be read."""
    code = ("import json, platform, torch\n"
            "try:\n import triton; tv = triton.__version__\nexcept ImportError:\n tv = 'not installed'\n"
            "print(json.dumps({'torch': torch.__version__, 'cuda': str(torch.version.cuda), 'triton': tv,"
            " 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        versions = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        versions = {"torch": "unknown", "cuda": "unknown", "triton": "unknown", "gpu": "unknown"}
    return {**versions, "python": platform.python_version()}


def _commit(explicit: str | None) -> str:
    """The commit a run records: ``--commit``, else ``$MOELORA_COMMIT``, else git's HEAD with
    ``-dirty`` appended when tracked files differ from it. A GPU host that gets a copy of the working
    tree can carry git metadata of an older commit (seen on the H200 host on 2026-12-04: HEAD one
    commit behind the tree), so HEAD alone would name code that did not run."""
    if explicit:
        return explicit
    if os.environ.get("MOELORA_COMMIT"):
        return os.environ["MOELORA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        head = out.stdout.strip()
        if not head:
            return "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=30)
        return f"{head}-dirty" if status.returncode != 0 or status.stdout.strip() else head
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- the cells' commands --------------------------------------------------------------------------


def _mode_filter(cell: Cell) -> str:
    """The pytest ``-k`` expression of a conformance cell: items of its mode and dtype. Graph-family
    items (ids ``decode-<dtype>`` / ``prefill-<dtype>``) go with the decode and prefill-full cells."""
    mode, dtype = cell.axes["mode"], cell.axes["dtype"]
    terms = [f"{mode}-{dtype}"]
    if mode == "prefill-full":
        terms.append(f"prefill-{dtype}")
    return " or ".join(terms)


def _peers_mode_filter(cell: Cell) -> str:
    """The ``-k`` expression of a peers cell: its mode's items in every dtype (item ids end in
    ``[<mode>-<dtype>]``; graph-family items ``decode-<dtype>`` / ``prefill-<dtype>`` go with the
    decode and prefill-full cells, as in :func:`_mode_filter`)."""
    mode = cell.axes["mode"]
    terms = [f"{mode}-{d}" for d in ("bf16", "fp16", "fp32")]
    if mode == "prefill-full":
        terms += [f"prefill-{d}" for d in ("bf16", "fp16", "fp32")]
    return " or ".join(terms)


#: Seconds a kernels cell leaves pytest, between its interrupt and the cell's timeout, to report.
KERNELS_REPORT_S = 40.0


def command(cell: Cell, work: Path, timeout_s: float | None = None) -> list[str]:
    """The command line of ``cell``, writing its suite's own report under ``work``; ``timeout_s``:
    the time it will get (default its own timeout; less where the run's budget cuts it), from which
    a kernels cell sets when pytest is interrupted so that it still reports.

    Raises:
        MatrixError: a suite without a command here yet.
    """
    py, suite, o = sys.executable, cell.axes["suite"], cell.options
    if suite == "kernels":
        # pytest interrupted before the cell's timeout, so the record keeps what ran and how long
        cmd = [py, "ci/gpu/kernels_gpu.py", "--profile", cell.axes["profile"], "--out", str(work / "kernels.json"),
               "--budget-s", f"{max(30.0, (timeout_s or cell.timeout_s) - KERNELS_REPORT_S):.0f}"]
        for test in cell.tests:
            cmd += ["--tests", test]
        if "pytest_k" in o:
            cmd += ["--", "-k", str(o["pytest_k"])]
        return cmd
    if suite == "conformance":
        cmd = [py, "-m", "pytest", "-p", "moelora_conformance.plugin", "-p", "no:cacheprovider",
               "--backend", cell.target, "--device", "cuda", "--profile", cell.axes["profile"],
               "--report-json", str(work / "report.json"), "-q", "-rfE", "-k", _mode_filter(cell)]
        if cell.manifest:
            cmd += ["--manifest", str(ROOT / cell.manifest)]
        if "max_examples" in o:
            cmd += ["--max-examples", str(o["max_examples"])]
        return cmd
    if suite == "peers":
        # every dtype the path declares on CUDA, the mode's items; no shrinking (a cell's time is its draws)
        cmd = [py, "-m", "pytest", "-p", "moelora_conformance.plugin", "-p", "no:cacheprovider",
               "--backend", cell.target, "--device", "cuda", "--profile", cell.axes["profile"],
               "--report-json", str(work / "report.json"), "-q", "-rfE", "-k", _peers_mode_filter(cell),
               "--no-shrink", f"--hypothesis-seed={PEERS_SEED}"]
        if cell.manifest:
            cmd += ["--manifest", str(ROOT / cell.manifest)]
        if "max_examples" in o:
            cmd += ["--max-examples", str(o["max_examples"])]
        return cmd
    if suite == "graphs":
        return [py, "ci/gpu/graph_agreement.py", "--seeds", str(o.get("seeds", 3)), "--overhead",
                "--out", str(work / "graphs.txt")]
    if suite == "engine":
        if not cell.tests:
            raise MatrixError(f"cell {cell.id}: an engine cell names its test files (parts.<name>.tests)")
        return [py, "-m", "pytest", *(f"packages/runner/tests/{t}" for t in cell.tests), "-q", "-rfE",
                "-p", "no:cacheprovider", "--junitxml", str(work / "junit.xml")]
    if suite == "e2e":
        return _e2e_command(cell, work)
    if suite == "benchmarks":
        script = str(o.get("script", "benchmarks/bench_moe_lora.py"))
        return [py, script, "--out", str(work / "bench.json"), *map(str, o.get("script_args", []))]
    raise MatrixError(f"cell {cell.id}: no command for suite {suite!r} yet")


def cell_env(cell: Cell, env: dict[str, str], work: Path) -> dict[str, str]:
    """The environment of ``cell``: the common one, plus, for engine cells, the runner tests' CUDA
    switches (engines on the GPU in the cell's dtype, the gpu profile, measurements under ``work``),
    for kernels cells with ``max_examples`` the profile's example count overridden, and for peers
    cells the peers' adapters, files and libraries (:data:`PEERS_FOLDER`)."""
    if cell.axes["suite"] == "kernels" and "max_examples" in cell.options:
        # the example budget that fits a call (the layer tests run the oracle on the host: ~6 s an example)
        return dict(env, MOELORA_MAX_EXAMPLES=str(cell.options["max_examples"]))
    if cell.axes["suite"] == "peers":
        folder = ROOT / PEERS_FOLDER
        path = os.pathsep.join([str(ROOT / "packages/peers/src"), str(folder / "site"), env.get("PYTHONPATH", "")])
        return dict(env, PYTHONPATH=path, MOELORA_PEERS_ROOT=str(folder / "root"))
    if cell.axes["suite"] != "engine":
        return env
    dtype = TORCH_DTYPE.get(cell.axes["dtype"], "bfloat16")
    return dict(env, MOELORA_RUNNER_DEVICE="cuda", MOELORA_RUNNER_DTYPE=dtype, MOELORA_PROFILE=cell.axes["profile"],
                MOELORA_GPU_OUT=str(work))


def _junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"] + total["errors"], "skipped": total["skipped"]}
#: The e2e suite's engine mode of each matrix mode (the layer suite's names, DESIGN.md §6).
E2E_MODE = {"eager": "eager", "decode": "decode_graph", "prefill-full": "full", "prefill-breakable": "breakable"}
#: torch dtype names of the matrix's dtypes.
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _e2e_command(cell: Cell, work: Path) -> list[str]:
    """``moelora-conformance e2e`` of one cell: its backend on its fixture family, eager (the graph
    modes' reference) plus its mode, real CUDA graphs, its dtype; a cell with mode "-" runs the
    stateful engine properties (E06) with the eager workload. The fixtures are built by the command."""
    mode, o = cell.axes["mode"], cell.options
    modes = "eager" if mode in ("-", "eager") else f"eager,{E2E_MODE[mode]}"
    cmd = [sys.executable, "-m", "moelora_conformance", "e2e", "--backend", cell.target, "--device", "cuda",
           "--dtype", TORCH_DTYPE[cell.axes["dtype"]], "--modes", modes, "--json", str(work / "report.json"),
           "--record-jsonl", str(work / "graph_vs_eager.jsonl"),
           "--state-machine-examples", str(o.get("state_machine_examples", 20) if mode == "-" else 0)]
    if cell.axes["family"] != "-":
        cmd += ["--families", cell.axes["family"]]
    if cell.manifest:
        cmd += ["--manifest", str(ROOT / cell.manifest)]
    for key in ("requests", "max_new_tokens"):
        if key in o:
            cmd += [f"--{key.replace('_', '-')}", str(o[key])]
    return cmd


def _status(exit_code: int | None, timed_out: bool) -> str:
    # 124: the suite stopped itself at the time it was given (kernels_gpu.py --budget-s)
    if timed_out or exit_code == 124:
        return "timeout"
    return {0: "pass", 1: "fail", 5: "nothing-ran"}.get(exit_code, "error")


def summarize(cell: Cell, work: Path) -> dict:
    """What the cell's own report says: outcome counts, examples run, the max error against its
    tolerance where the suite records one, the first failure messages (empty without a report)."""
    out: dict[str, object] = {}
    report = work / "report.json"
    if cell.axes["suite"] in ("conformance", "peers", "e2e") and report.is_file():
        data = json.loads(report.read_text())
        records = data.get("records", [])
        counts: dict[str, int] = {}
        for r in records:
            counts[r.get("outcome", "?")] = counts.get(r.get("outcome", "?"), 0) + 1
        out["counts"] = counts
        out["examples"] = sum(int(r.get("examples_run") or 0) for r in records) or None
        errors = [(r["max_error"], r.get("tolerance")) for r in records if r.get("max_error") is not None]
        if errors:
            worst = max(errors, key=lambda e: e[0] / e[1] if e[1] else e[0])
            out["max_error"], out["tolerance"] = worst
        out["failures"] = [f"{r.get('test')}: {r.get('message', '')}"[:300] for r in records
                           if r.get("outcome") in ("failed", "error")][:5]
        not_run = [f"{r.get('test')}: {r.get('message', '')}"[:300] for r in records if r.get("outcome") == "not_run"]
        if not_run:
            out["not_run"] = not_run[:5]
    measured = work / "graph_vs_eager.jsonl"
    if cell.axes["suite"] == "e2e" and measured.is_file():
        # The e2e suite appends each graph-vs-eager measurement before asserting, so a failing cell
        # still says what it measured (the GPU rows of the tolerance policy are set from these).
        lines = [json.loads(line) for line in measured.read_text().splitlines() if line.strip()]
        if lines:
            out["graph_vs_eager"] = {"max_abs": max(x["max_abs"] for x in lines),
                                     "mean_abs": max(x["mean_abs"] for x in lines),
                                     "count": sum(int(x.get("count", 0)) for x in lines)}
    kernels = work / "kernels.json"
    if cell.axes["suite"] == "kernels" and kernels.is_file():
        data = json.loads(kernels.read_text())
        out["counts"] = data.get("summary", {})
        out["examples"] = sum(v.get("passing", 0) for v in data.get("examples", {}).values()) or None
    junit = work / "junit.xml"
    if cell.axes["suite"] == "engine" and junit.is_file():
        out["counts"] = _junit_counts(junit)
    bench = work / "bench.json"
    if cell.axes["suite"] == "benchmarks" and bench.is_file():
        data = json.loads(bench.read_text())
        # each error against its own bound (the bench's ``error_bounds``; 2e-2 where an older bench wrote none)
        bounds = {"default": 2e-2, **data.get("error_bounds", {})}
        errs = [(v, bounds.get(k, bounds["default"])) for r in data.get("rows", []) for k, v in r.items()
                if k.startswith("err_") and isinstance(v, int | float)]
        if errs:
            out["max_error"], out["tolerance"] = max(errs, key=lambda e: e[0] / e[1])
    return out


# --- run -----------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # real kernels on the GPU
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / s) for s in SOURCES] + [env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cell(cell: Cell, timeout_s: float, log, env: dict[str, str]) -> tuple[dict, float]:
    """Run one cell in its own process group; (its record fields, wall seconds)."""
    with tempfile.TemporaryDirectory(prefix="moelora-cell-") as tmp:
        work = Path(tmp)
        try:
            cmd = command(cell, work, timeout_s)
        except MatrixError as exc:
            return {"status": "error", "exit_code": None, "message": str(exc)}, 0.0
        log.write(f"\n== {cell.id} (timeout {timeout_s:.0f} s): {' '.join(cmd)}\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cell_env(cell, env, work), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGINT)  # pytest still writes its reports on SIGINT
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.monotonic() - start
        fields = {"status": _status(proc.returncode, timed_out), "exit_code": proc.returncode}
        if fields["status"] == "timeout" and timeout_s < cell.timeout_s:
            # the run's budget, not the cell's own timeout, cut it (the runner's timeout fired, or the
            # suite stopped itself at the time it was given: exit 124): not a finding, --resume runs it again
            fields["status"] = "cut"
        try:
            fields.update(summarize(cell, work))
        except (OSError, ValueError, KeyError) as exc:
            fields["message"] = f"could not read the cell's report: {exc}"
        if fields["status"] == "pass" and fields.get("not_run"):
            fields["status"] = "incomplete"
        return fields, wall


def _cell_threads(jobs: int) -> dict[str, str]:
    """Thread caps of a cell's process when ``jobs`` cells share the host: the host's cores split
    between them (torch and numpy default to every core each, so six cells would oversubscribe)."""
    if jobs <= 1:
        return {}
    n = str(max(1, (os.cpu_count() or jobs) // jobs))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def run(cells: Sequence[Cell], *, out_dir: Path, budget_s: float | None, resume: Sequence[Path],
        commit: str, jobs: int = 1, now=time.monotonic, runner=run_cell) -> list[dict]:
    """Run ``cells`` (module doc), up to ``jobs`` at a time in file order; returns the records
    written this run, in the order the cells finished.

    A cell starts only when its estimate fits what is left of ``budget_s``; the first that does not
    stops the run (the cells after it stay for ``--resume``, as with one job). A cell whose options
    say ``exclusive = true`` (the benchmarks: their times are the result) runs alone: it waits for
    the running cells to end, and no cell starts beside it. Each cell's output goes to a file of its
    own and is appended to ``matrix.log`` as one block when it ends, so parallel cells' lines do not
    interleave; its record carries ``jobs`` (its seconds are a shared host's when ``jobs`` > 1).

    Raises:
        ValueError: ``jobs`` < 1.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    out_dir.mkdir(parents=True, exist_ok=True)
    done = read_records([*resume, out_dir / RECORDS])
    todo = collections.deque(c for c in cells if not (c.id in done and is_current(c, done[c.id])))
    env = {**_env(), **_cell_threads(jobs)}
    versions = _versions() if todo else {}
    start = now()
    written: list[dict] = []
    lock = threading.Lock()

    def one(cell: Cell, timeout: float) -> None:
        with tempfile.TemporaryFile("w+") as own:
            fields, wall = runner(cell, timeout, own, env)
            own.flush()
            own.seek(0)
            text = own.read()
        rec = {"cell": cell.id, **cell.axes, **fields, "seconds": round(wall, 1), "estimate_s": cell.estimate_s,
               "jobs": jobs, "definition": cell.definition, "commit": commit,
               "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **versions}
        with lock:
            log.write(text)
            log.flush()
            records.write(json.dumps(rec) + "\n")
            records.flush()
            written.append(rec)
            print(f"{cell.id:<60} {rec['status']:<11} {wall:7.1f} s", flush=True)

    with open(out_dir / LOG, "a") as log, open(out_dir / RECORDS, "a") as records, \
            concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        running: dict[concurrent.futures.Future, Cell] = {}
        stopped = False
        while todo or running:
            while todo and not stopped and len(running) < jobs:
                cell = todo[0]
                alone = bool(cell.options.get("exclusive"))
                if running and (alone or any(c.options.get("exclusive") for c in running.values())):
                    break
                left = None if budget_s is None else budget_s - (now() - start)
                if left is not None and left < cell.estimate_s:
                    with lock:
                        log.write(f"\n== budget: {left:.0f} s left < {cell.estimate_s:.0f} s estimated for "
                                  f"{cell.id}; stopping ({len(todo)} cells left for --resume)\n")
                    stopped = True
                    break
                todo.popleft()
                timeout = cell.timeout_s if left is None else min(cell.timeout_s, left)
                running[pool.submit(one, cell, timeout)] = cell
            if not running:
                break
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in finished:
                running.pop(f)
                f.result()  # a runner bug surfaces here instead of vanishing in a thread
    return written


# --- report --------------------------------------------------------------------------------------


def is_current(cell: Cell, record: dict) -> bool:
    """Whether ``record`` was made under ``cell``'s present definition. Records written before
    definitions were recorded (no ``definition`` key) count as current."""
    return record.get("definition", cell.definition) == cell.definition


def report_rows(cells: Sequence[Cell], records: dict[str, dict]) -> list[dict]:
    """One row per cell of the matrix, in matrix order; cells without a record, or whose record was
    made under another definition of the cell (its tests or options changed since), are "not-run"."""
    rows = []
    for c in cells:
        rec = records.get(c.id)
        if rec is not None and not is_current(c, rec):
            rec = None
        rows.append({"cell": c.id, **c.axes, "status": rec["status"] if rec else "not-run", "record": rec})
    return rows


def _fmt_error(rec: dict | None) -> str:
    if not rec or rec.get("max_error") is None:
        return "–"
    tol = rec.get("tolerance")
    return f"{rec['max_error']:.2e} / {tol:.0e}" if tol else f"{rec['max_error']:.2e}"


def render_markdown(rows: Sequence[dict]) -> str:
    """The report as Markdown: a status summary, then one table row per cell."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    recs = [r["record"] for r in rows if r["record"]]
    commits = sorted({r.get("commit", "unknown") for r in recs})
    gpus = sorted({r.get("gpu", "unknown") for r in recs})
    lines = ["# GPU matrix report", "",
             f"{len(rows)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), "",
             f"GPUs: {', '.join(gpus) or '–'}; commits: {', '.join(c[:12] for c in commits) or '–'}", "",
             "| cell | status | max error / tol | examples | seconds | finished | torch / triton | commit |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = r["record"] or {}
        ver = f"{rec.get('torch', '–')} / {rec.get('triton', '–')}" if rec else "–"
        lines.append(f"| `{r['cell']}` | {r['status']} | {_fmt_error(rec)} | {rec.get('examples') or '–'} | "
                     f"{rec.get('seconds', '–')} | {rec.get('finished', '–')[:10]} | {ver} | "
                     f"{rec.get('commit', '–')[:12]} |")
    fails = [r for r in rows if r["status"] in ("incomplete", "fail", "error", "timeout", "nothing-ran")]
    if fails:
        lines += ["", "## Not passing", ""]
        for r in fails:
            rec = r["record"] or {}
            detail = ("; ".join(rec.get("failures") or rec.get("not_run") or []) or rec.get("message", "")
                      or f"exit {rec.get('exit_code')}")
            lines.append(f"- `{r['cell']}` ({r['status']}): {detail}")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- gpu-matrix:begin (generated by ci/gpu/matrix.py report --status; do not edit) -->"
README_END = "<!-- gpu-matrix:end -->"
STATUS_ORDER = ("pass", "incomplete", "fail", "error", "timeout", "nothing-ran", "not-run")


def render_summary(rows: Sequence[dict]) -> str:
    """The GPU block of the status document (docs/status.md): one line per suite (cells, each status's
    count, the newest run's date and commits), generated from the same rows as the report so the
    document cannot claim more."""
    suites: dict[str, list[dict]] = {}
    for r in rows:
        suites.setdefault(r["suite"], []).append(r)
    lines = ["| suite | cells | " + " | ".join(STATUS_ORDER) + " | last run | commits |",
             "|---|---|" + "---|" * len(STATUS_ORDER) + "---|---|"]
    for suite, rs in suites.items():
        recs = [r["record"] for r in rs if r["record"]]
        last = max((rec.get("finished", "")[:10] for rec in recs), default="") or "–"
        commits = ", ".join(sorted({rec.get("commit", "?")[:7] for rec in recs})) or "–"
        counts = [sum(1 for r in rs if r["status"] == st) for st in STATUS_ORDER]
        lines.append(f"| {suite} | {len(rs)} | " + " | ".join(str(n) if n else "·" for n in counts)
                     + f" | {last} | {commits} |")
    total = [sum(1 for r in rows if r["status"] == st) for st in STATUS_ORDER]
    lines.append(f"| **all** | {len(rows)} | " + " | ".join(str(n) if n else "·" for n in total) + " | | |")
    return "\n".join(lines) + "\n"


def update_readme(path: Path, rows: Sequence[dict]) -> None:
    """Replace the block between :data:`README_BEGIN` and :data:`README_END` in ``path`` with
    :func:`render_summary` of ``rows``.

    Raises:
        MatrixError: the file lacks the markers (nothing is written).
    """
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise MatrixError(f"{path}: no '{README_BEGIN}' ... '{README_END}' block to fill")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(f"{head}{README_BEGIN}\n{render_summary(rows)}{README_END}{tail}")


# --- CLI -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, default=MATRIX, help="the matrix file (default ci/matrix.toml)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="print the selected cells with their estimates")
    p_run = sub.add_parser("run", help="run the selected cells")
    p_rep = sub.add_parser("report", help="merge records into one report")
    for p in (p_list, p_run, p_rep):
        p.add_argument("--select", action="append", default=None, help="cells to take (module doc; repeatable)")
    p_run.add_argument("--out-dir", type=Path, required=True, help="records.jsonl and matrix.log go here")
    p_run.add_argument("--budget-s", type=float, default=None, help="stop before a cell that would pass this")
    p_run.add_argument("--resume", type=Path, action="append", default=[], help="records of earlier runs to skip")
    p_run.add_argument("--jobs", type=int, default=1,
                       help="cells at a time on one GPU host (the small cells are host-bound; default 1)")
    p_run.add_argument("--commit", default=None, help="the commit under test (default: git, or $MOELORA_COMMIT)")
    p_rep.add_argument("records", type=Path, nargs="+", help="records.jsonl files or folders of *.jsonl")
    p_rep.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here")
    p_rep.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    p_rep.add_argument("--status", "--readme", dest="status", type=Path, default=None,
                       help="fill this file's gpu-matrix block (docs/status.md)")
    args = parser.parse_args(argv)
    try:
        cells = select(load_matrix(args.matrix), args.select)
    except (MatrixError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"matrix: {exc}", file=sys.stderr)
        return 2
    if not cells:
        print("matrix: no cell matches --select", file=sys.stderr)
        return 2
    if args.command == "list":
        for c in cells:
            print(f"{c.id:<60} ~{c.estimate_s:5.0f} s")
        print(f"{len(cells)} cells, ~{sum(c.estimate_s for c in cells) / 60:.0f} minutes")
        return 0
    if args.command == "run":
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            # started in the background (`cmd &` in a script): the cells would inherit SIGINT
            # ignored and never stop at their timeout's interrupt to write their reports
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            written = run(cells, out_dir=args.out_dir, budget_s=args.budget_s, resume=args.resume,
                          commit=_commit(args.commit), jobs=args.jobs)
        except ValueError as exc:  # --jobs < 1, or a records line that is not JSON
            print(f"matrix: {exc}", file=sys.stderr)
            return 2
        return 0 if all(r["status"] == "pass" for r in written) else 1
    rows = report_rows(cells, read_records(args.records))
    md = render_markdown(rows)
    if args.markdown:
        args.markdown.write_text(md)
    else:
        print(md)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items()} for r in rows], indent=1))
    if args.status:
        try:
            update_readme(args.status, rows)
        except (MatrixError, OSError) as exc:
            print(f"matrix: {exc}", file=sys.stderr)
            return 2
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
