"""The GPU matrix runner (``ci/gpu/matrix.py``) on the CPU: cells from groups, selection, resume,
the budget stop, the report merge, and a command for every cell of ``ci/matrix.toml``.

Cells run through a fake runner and a fake clock here; the real cells need a GPU host.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ci_matrix", ROOT / "ci" / "gpu" / "matrix.py")
matrix = importlib.util.module_from_spec(_spec)
sys.modules["ci_matrix"] = matrix
_spec.loader.exec_module(matrix)

SMALL = """
[backends]
reference = { target = "reference", manifest = "" }
mine = { target = "my_pkg.mod:make", manifest = "mine.toml" }

[[group]]
suite = "kernels"
profile = "gpu"
estimate_s = 100

[[group]]
suite = "conformance"
backend = ["reference", "mine"]
mode = ["eager", "decode"]
dtype = ["bf16", "fp16"]
profile = "gpu"
max_examples = 2
estimate_s = 50
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(SMALL)
    return matrix.load_matrix(path)


def test_groups_expand_to_the_product_of_their_list_axes_with_stable_ids(small):
    ids = [c.id for c in small]
    assert ids[0] == "kernels/-/-/-/-/gpu"
    assert len(ids) == 1 + 2 * 2 * 2
    assert "conformance/mine/decode/fp16/-/gpu" in ids
    mine = next(c for c in small if c.axes["backend"] == "mine")
    assert (mine.target, mine.manifest, mine.options) == ("my_pkg.mod:make", "mine.toml", {"max_examples": 2})
    assert mine.timeout_s == 75  # 1.5 x the estimate by default


@pytest.mark.parametrize("text, problem", [
    ('[[group]]\nsuite = "kernels"\n', "estimate_s"),
    ('[[group]]\nsuite = "unit"\nestimate_s = 1\n', "unknown suite"),
    ('[[group]]\nsuite = "conformance"\nbackend = "ghost"\nestimate_s = 1\n', "not declared"),
    ('[[group]]\nsuite = "kernels"\nestimate_s = 1\n[[group]]\nsuite = "kernels"\nestimate_s = 2\n', "same id"),
    ('[[group]]\nsuite = "kernels"\nestimate_s = 1\nparts = ["a", "b"]\n', "table of tables"),
])
def test_a_malformed_matrix_is_refused_by_name(tmp_path, text, problem):
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(matrix.MatrixError, match=problem):
        matrix.load_matrix(path)


def test_select_by_axes_and_by_id_glob(small):
    picked = matrix.select(small, ["suite=conformance,backend=mine,dtype=bf16"])
    assert [c.id for c in picked] == ["conformance/mine/eager/bf16/-/gpu", "conformance/mine/decode/bf16/-/gpu"]
    assert [c.id for c in matrix.select(small, ["kernels/*", "*/reference/decode/fp16/*"])] == [
        "kernels/-/-/-/-/gpu", "conformance/reference/decode/fp16/-/gpu"]
    assert matrix.select(small, None) == small
    with pytest.raises(matrix.MatrixError, match="unknown axis"):
        matrix.select(small, ["colour=red"])


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_runner(clock, outcomes):
    ran = []

    def runner(cell, timeout, log, env):
        ran.append((cell.id, timeout))
        clock.t += cell.estimate_s
        return {"status": outcomes.get(cell.id, "pass"), "exit_code": 0}, cell.estimate_s
    return runner, ran


def test_the_budget_stops_before_a_cell_that_does_not_fit_and_resume_runs_the_rest(small, tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "_versions", lambda: {"torch": "t", "triton": "tr", "gpu": "g"})
    clock = FakeClock()
    runner, _ = fake_runner(clock, {"conformance/reference/eager/fp16/-/gpu": "fail"})
    out = tmp_path / "run1"
    first = matrix.run(small, out_dir=out, budget_s=210, resume=[], commit="abc", now=clock, runner=runner)
    # kernels 100 s + two cells of 50 s = 200 s; the third cell's 50 s no longer fit in the 10 s left
    assert [r["cell"] for r in first] == [c.id for c in small[:3]]
    assert [r["status"] for r in first] == ["pass", "pass", "fail"]
    assert "stopping (6 cells left for --resume)" in (out / "matrix.log").read_text()
    lines = (out / "records.jsonl").read_text().splitlines()
    assert [json.loads(x)["cell"] for x in lines] == [r["cell"] for r in first]
    assert json.loads(lines[0])["commit"] == "abc" and json.loads(lines[0])["torch"] == "t"
    # a second run resumes: it skips every recorded cell, failed ones included
    runner2, ran2 = fake_runner(clock, {})
    second = matrix.run(small, out_dir=tmp_path / "run2", budget_s=None, resume=[out], commit="abc", now=clock,
                        runner=runner2)
    assert [c for c, _ in ran2] == [c.id for c in small[3:]]
    assert len(second) == 6
    # a cell's timeout never exceeds what is left of the budget
    clock3 = FakeClock()
    runner3, ran3 = fake_runner(clock3, {})
    matrix.run(small[:2], out_dir=tmp_path / "run3", budget_s=130, resume=[], commit="x", now=clock3, runner=runner3)
    assert ran3 == [("kernels/-/-/-/-/gpu", 130.0)]


def test_the_report_lists_every_cell_and_the_newest_record_wins(small, tmp_path):
    rec = lambda cell, status, finished, **kw: json.dumps(
        {"cell": cell, "status": status, "finished": finished, "seconds": 1.0, "commit": "c0ffee", **kw})
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join([rec("kernels/-/-/-/-/gpu", "fail", "2026-12-01T10:00:00", failures=["t: boom"]),
                            rec("conformance/mine/eager/bf16/-/gpu", "pass", "2026-12-01T10:00:00",
                                max_error=3e-3, tolerance=2e-2)]))
    b.write_text("\n".join([rec("kernels/-/-/-/-/gpu", "pass", "2026-12-02T10:00:00"),
                            rec("conformance/mine/eager/fp16/-/gpu", "not-run", "2026-12-02T10:00:00")]))
    records = matrix.read_records([tmp_path])
    rows = matrix.report_rows(small, records)
    status = {r["cell"]: r["status"] for r in rows}
    assert len(rows) == len(small)
    assert status["kernels/-/-/-/-/gpu"] == "pass"  # the newer record
    assert status["conformance/mine/eager/bf16/-/gpu"] == "pass"
    assert status["conformance/mine/eager/fp16/-/gpu"] == "not-run"  # an unfinished record is no result
    md = matrix.render_markdown(rows)
    assert "9 cells: 7 not-run, 2 pass" in md
    assert "3.00e-03 / 2e-02" in md
    assert md.count("| `") == len(small)


def test_every_cell_of_the_repository_matrix_has_a_command(tmp_path):
    cells = matrix.load_matrix()
    assert cells, "ci/matrix.toml has no cells"
    for cell in cells:
        cmd = matrix.command(cell, tmp_path)
        assert cmd and cmd[0] == sys.executable, cell.id
        assert cell.estimate_s <= 480, f"{cell.id}: cells are sized to at most 8 minutes"
        if cell.axes["suite"] == "conformance":
            assert "-k" in cmd and cmd[cmd.index("--backend") + 1] == cell.target


def test_parts_split_a_cell_into_calls_with_their_own_tests_estimates_and_options(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[[group]]\nsuite = "kernels"\nprofile = "gpu"\nestimate_s = 100\n'
                    '[group.parts.routing]\ntests = ["test_kernel_align.py", "test_kernel_mapping.py"]\n'
                    '[group.parts.lora]\ntests = ["test_kernel_moe_lora.py"]\nestimate_s = 300\n'
                    '[[group]]\nsuite = "benchmarks"\nestimate_s = 10\n'
                    '[group.parts.engine]\nscript = "benchmarks/bench_engine.py"\n'
                    '[[group]]\nsuite = "engine"\ndtype = "fp16"\nprofile = "gpu"\nestimate_s = 10\n'
                    '[group.parts.graphs]\ntests = ["test_graph_state.py"]\n')
    cells = matrix.load_matrix(path)
    assert [c.id for c in cells] == ["kernels/-/-/-/-/gpu:routing", "kernels/-/-/-/-/gpu:lora",
                                     "benchmarks/-/-/-/-/-:engine", "engine/-/-/fp16/-/gpu:graphs"]
    routing, lora, bench, engine = cells
    assert (routing.estimate_s, routing.timeout_s, lora.estimate_s, lora.timeout_s) == (100, 150, 300, 450)
    cmd = matrix.command(routing, tmp_path)
    assert cmd[cmd.index("--tests") + 1] == "test_kernel_align.py" and cmd.count("--tests") == 2
    # a kernels part's max_examples overrides the profile's example count; the others keep it
    layer = matrix.Cell({a: "-" for a in matrix.AXES} | {"suite": "kernels", "profile": "gpu"}, 1.0, 1.0,
                        {"max_examples": 40, "pytest_k": "test_layer"}, tests=("test_kernel_moe_lora.py",))
    assert matrix.cell_env(layer, {"A": "1"}, tmp_path) == {"A": "1", "MOELORA_MAX_EXAMPLES": "40"}
    assert matrix.cell_env(routing, {"A": "1"}, tmp_path) == {"A": "1"}
    assert matrix.command(layer, tmp_path)[-2:] == ["-k", "test_layer"]
    # pytest is interrupted before the cell's timeout, leaving it time to report what ran
    assert float(cmd[cmd.index("--budget-s") + 1]) == routing.timeout_s - matrix.KERNELS_REPORT_S
    assert "benchmarks/bench_engine.py" in matrix.command(bench, tmp_path)
    cmd = matrix.command(engine, tmp_path)
    assert "packages/runner/tests/test_graph_state.py" in cmd and "--junitxml" in cmd
    env = matrix.cell_env(engine, {"A": "1"}, tmp_path)
    assert (env["MOELORA_RUNNER_DEVICE"], env["MOELORA_RUNNER_DTYPE"], env["A"]) == ("cuda", "float16", "1")
    assert matrix.cell_env(routing, {"A": "1"}, tmp_path) == {"A": "1"}
    assert matrix.select(cells, ["kernels/*"]) == [routing, lora]


def test_engine_cells_report_their_junit_counts(tmp_path):
    (tmp_path / "junit.xml").write_text('<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1"/>'
                                        '</testsuites>')
    cell = matrix.Cell({a: "-" for a in matrix.AXES} | {"suite": "engine"}, 1.0, 1.0)
    assert matrix.summarize(cell, tmp_path)["counts"] == {"passed": 2, "failed": 2, "skipped": 1}


def test_benchmarks_cells_report_the_worst_error_against_its_own_bound(tmp_path):
    """The fp8 base's 6.7e-2 against the bf16 base (bound 1e-1) once showed as "6.68e-02 / 2e-02" on a
    passing cell: each error is judged by the bound the bench wrote for it."""
    rows = [{"err_a": 3e-3, "err_fused": 1e-2, "err_a_fp8": 6.7e-2}, {"err_a": 4e-3, "err_a_fp8": 5e-2}]
    bench = {"rows": rows, "error_bounds": {"default": 2e-2, "err_a_fp8": 1e-1}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    cell = matrix.Cell({a: "-" for a in matrix.AXES} | {"suite": "benchmarks"}, 1.0, 1.0)
    got = matrix.summarize(cell, tmp_path)
    assert (got["max_error"], got["tolerance"]) == (6.7e-2, 1e-1)
    rows[0]["err_fused"] = 1.9e-2  # now the nearest to its bound
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert (matrix.summarize(cell, tmp_path)["max_error"], matrix.summarize(cell, tmp_path)["tolerance"]) == (
        1.9e-2, 2e-2)
    del bench["error_bounds"]  # an older bench: every error against 2e-2
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert matrix.summarize(cell, tmp_path)["max_error"] == 6.7e-2


def test_conformance_cells_select_their_mode_and_dtype_items_only():
    cells = {c.id: c for c in matrix.load_matrix()}
    k = lambda cid: matrix._mode_filter(cells[cid])
    assert k("conformance/triton/eager/bf16/-/gpu") == "eager-bf16"
    assert k("conformance/triton/prefill-full/fp16/-/gpu") == "prefill-full-fp16 or prefill-fp16"
    assert k("conformance/csgmv/decode/fp32/-/gpu") == "decode-fp32"


def test_peers_cells_run_each_path_per_mode_and_profile_with_the_peers_folder(tmp_path):
    cells = [c for c in matrix.load_matrix() if c.axes["suite"] == "peers"]
    paths = {c.target for c in cells}
    assert paths == {"moelora_peers.sglang:legacy", "moelora_peers.sglang:virtual_experts",
                     "moelora_peers.sglang:grouped", "moelora_peers.vllm:fused"}
    # x graph mode x profile (interpret, gpu); grouped has no interpret cells: on CUDA it declares bf16
    # only, which the interpret profile does not draw
    assert len(cells) == len(paths) * 4 * 2 - 4
    assert not [c.id for c in cells if "sglang-grouped" in c.id and c.axes["profile"] == "interpret"]
    for c in cells:
        assert (matrix.ROOT / c.manifest).is_file(), c.manifest
    cell = next(c for c in cells if c.id == "peers/sglang-grouped/prefill-full/-/-/gpu")
    cmd = matrix.command(cell, tmp_path)
    assert cmd[cmd.index("-k") + 1] == ("prefill-full-bf16 or prefill-full-fp16 or prefill-full-fp32 or "
                                       "prefill-bf16 or prefill-fp16 or prefill-fp32")
    assert "--no-shrink" in cmd and cmd[cmd.index("--max-examples") + 1] == "2"
    env = matrix.cell_env(cell, {"PYTHONPATH": "src"}, tmp_path)
    assert env["MOELORA_PEERS_ROOT"] == str(matrix.ROOT / ".gpu/peers/root")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(matrix.ROOT / "packages/peers/src"),
                                                   str(matrix.ROOT / ".gpu/peers/site"), "src"]


def test_the_cli_lists_cells_and_refuses_a_selection_that_matches_nothing(capsys):
    assert matrix.main(["list", "--select", "suite=kernels"]) == 0
    assert "kernels/-/-/-/-/gpu" in capsys.readouterr().out
    assert matrix.main(["list", "--select", "suite=e2e,backend=nobody"]) == 2
    assert "no cell matches" in capsys.readouterr().err


def test_e2e_cells_run_eager_and_their_engine_mode_on_cuda_in_their_dtype(tmp_path):
    cells = {c.id: c for c in matrix.load_matrix()}
    cmd = matrix.command(cells["e2e/triton/prefill-breakable/bf16/qwen3_moe/-"], tmp_path)
    assert cmd[1:4] == ["-m", "moelora_conformance", "e2e"]
    args = dict(zip(cmd[4::2], cmd[5::2]))
    assert args["--backend"] == "triton" and args["--device"] == "cuda" and args["--dtype"] == "bfloat16"
    assert args["--modes"] == "eager,breakable" and args["--families"] == "qwen3_moe"
    assert args["--state-machine-examples"] == "0" and args["--json"] == str(tmp_path / "report.json")
    stateful = dict(zip(*[iter(matrix.command(cells["e2e/csgmv/-/fp16/qwen3_moe/-"], tmp_path)[4:])] * 2))
    assert stateful["--modes"] == "eager" and stateful["--state-machine-examples"] == "20"


def test_an_e2e_cell_with_a_property_not_run_is_incomplete_not_a_pass(tmp_path, monkeypatch):
    """The fp16 e2e cells of 2026-12-02 exited 0 with E01 not run (no graph_vs_eager row for fp16)
    and were recorded as passes; such a cell is "incomplete" and its measurement is kept."""
    cell = {c.id: c for c in matrix.load_matrix()}["e2e/triton/decode/fp16/qwen3_moe/-"]
    work = tmp_path / "work"
    work.mkdir()
    (work / "report.json").write_text(json.dumps({"records": [
        {"test": "E01[triton-decode_graph-fp16-qwen3_moe]", "outcome": "not_run", "message": "no logprob tolerance"},
        {"test": "E03[triton-decode_graph-fp16-qwen3_moe]", "outcome": "passed"}]}))
    (work / "graph_vs_eager.jsonl").write_text(
        json.dumps({"max_abs": 3e-3, "mean_abs": 1e-4, "count": 10}) + "\n"
        + json.dumps({"max_abs": 1e-3, "mean_abs": 2e-4, "count": 5}) + "\n")
    summary = matrix.summarize(cell, work)
    assert summary["not_run"] == ["E01[triton-decode_graph-fp16-qwen3_moe]: no logprob tolerance"]
    assert summary["graph_vs_eager"] == {"max_abs": 3e-3, "mean_abs": 2e-4, "count": 15}

    class Done:
        returncode = 0
        pid = 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(matrix.subprocess, "Popen", lambda *a, **k: Done())
    monkeypatch.setattr(matrix, "summarize", lambda c, w: summary)
    fields, _ = matrix.run_cell(cell, 10.0, open(tmp_path / "log", "w"), {})
    assert fields["status"] == "incomplete"
    rows = matrix.report_rows([cell], {cell.id: {"cell": cell.id, **fields}})
    assert "E01[triton-decode_graph-fp16-qwen3_moe]" in matrix.render_markdown(rows).split("## Not passing")[1]


def test_the_readme_block_is_generated_from_the_records_and_a_file_without_it_is_refused(small, tmp_path):
    cells = small
    records = {cells[0].id: {"cell": cells[0].id, "status": "pass", "finished": "2026-12-02T10:00", "commit": "abcdef9"},
               cells[1].id: {"cell": cells[1].id, "status": "incomplete", "finished": "2026-12-01T10:00", "commit": "1234567"}}
    rows = matrix.report_rows(cells, records)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{matrix.README_BEGIN}\nstale\n{matrix.README_END}\nafter\n")
    matrix.update_readme(readme, rows)
    text = readme.read_text()
    assert "stale" not in text and text.endswith(f"{matrix.README_END}\nafter\n")
    line = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ")}
    kernels = [c.strip() for c in line["kernels"].split("|")[1:-1]]
    assert kernels[:3] == ["kernels", "1", "1"] and kernels[-2:] == ["2026-12-02", "abcdef9"]
    conformance = [c.strip() for c in line["conformance"].split("|")[1:-1]]
    assert conformance[1] == str(len(cells) - 1) and conformance[3] == "1"  # one incomplete
    assert conformance[2 + matrix.STATUS_ORDER.index("not-run")] == str(len(cells) - 2)
    bare = tmp_path / "bare.md"
    bare.write_text("no block\n")
    with pytest.raises(matrix.MatrixError, match="gpu-matrix"):
        matrix.update_readme(bare, rows)
    assert bare.read_text() == "no block\n"


def test_run_timed_keeps_what_an_interrupted_command_prints_as_it_stops(tmp_path, capsys):
    """A kernels cell cut by its budget: the child gets SIGINT, prints its summary, and every line
    (echoed live and in the log) is kept (ci/gpu/_record.py run_timed)."""
    sys.path.insert(0, str(Path(matrix.__file__).parent))
    from _record import run_timed

    # the child sets its own SIGINT handler: under xdist, workers ignore SIGINT and children inherit that
    child = ("import signal, time, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "print('started', flush=True)\n"
             "try:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    print('summary after interrupt', flush=True)\n"
             "    sys.exit(2)\n")
    log = tmp_path / "log.txt"
    proc, wall, output = run_timed([sys.executable, "-c", child], cwd=tmp_path, env=dict(os.environ), log=log,
                                   budget_s=1.0, echo=True)
    assert proc.returncode == 2 and wall < 20
    assert output.splitlines() == ["started", "summary after interrupt"] == log.read_text().splitlines()
    assert "summary after interrupt" in capsys.readouterr().out


def test_every_kernel_test_file_is_in_a_kernels_cell():
    """A kernel test file no part names would never run on the GPU (two new files were missed once)."""
    root = Path(matrix.__file__).resolve().parents[2]
    files = {p.name for p in (root / "packages/kernels/tests").glob("test_*.py")}
    named = {t for c in matrix.load_matrix(matrix.MATRIX) if c.axes["suite"] == "kernels" for t in c.tests}
    assert files - named == set(), sorted(files - named)
    assert named - files == set(), sorted(named - files)


PARALLEL = """
[backends]
reference = { target = "reference", manifest = "" }

[[group]]
suite = "conformance"
backend = "reference"
mode = ["eager", "decode", "prefill-full", "prefill-breakable"]
dtype = ["bf16", "fp16"]
profile = "gpu"
estimate_s = 50

[[group]]
suite = "benchmarks"
estimate_s = 20
exclusive = true
[group.parts.a]
script = "a.py"
[group.parts.b]
script = "b.py"

[[group]]
suite = "e2e"
backend = "reference"
mode = ["decode"]
dtype = "bf16"
estimate_s = 30
"""


def test_jobs_run_cells_side_by_side_and_an_exclusive_cell_alone(tmp_path, monkeypatch):
    """--jobs: at most N cells at once, an ``exclusive`` cell never beside another, every cell
    recorded once with its own log block, and the budget still stops the run."""
    import threading
    import time as _time

    monkeypatch.setattr(matrix, "_versions", lambda: {})
    path = tmp_path / "m.toml"
    path.write_text(PARALLEL)
    cells = matrix.load_matrix(path)
    lock, running, overlaps, peak = threading.Lock(), set(), [], [0]

    def runner(cell, timeout, log, env):
        with lock:
            running.add(cell.id)
            peak[0] = max(peak[0], len(running))
            if len(running) > 1 and any(c.startswith("benchmarks") for c in running):
                overlaps.append(sorted(running))
        log.write(f"output of {cell.id}\n")
        _time.sleep(0.05)
        with lock:
            running.discard(cell.id)
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 3) // 3))
        return {"status": "pass", "exit_code": 0}, 0.05

    out = tmp_path / "run"
    written = matrix.run(cells, out_dir=out, budget_s=None, resume=[], commit="c", jobs=3, runner=runner)
    assert sorted(r["cell"] for r in written) == sorted(c.id for c in cells)
    assert peak[0] == 3 and overlaps == []
    assert all(r["jobs"] == 3 for r in written)
    log = (out / "matrix.log").read_text()
    assert all(log.count(f"output of {c.id}\n") == 1 for c in cells)
    # the budget: cells start while their estimate fits what is left, then the run stops
    clock = FakeClock()

    def timed(cell, timeout, log, env):
        with lock:
            clock.t += 10
        return {"status": "pass", "exit_code": 0}, 10.0

    second = matrix.run(cells, out_dir=tmp_path / "run2", budget_s=75, resume=[], commit="c", jobs=2,
                        now=clock, runner=timed)
    assert 2 <= len(second) < len(cells)
    assert "stopping (" in (tmp_path / "run2" / "matrix.log").read_text()
    with pytest.raises(ValueError, match="jobs"):
        matrix.run(cells, out_dir=tmp_path / "run3", budget_s=None, resume=[], commit="c", jobs=0, runner=timed)


def test_the_repository_benchmarks_cells_are_exclusive():
    """Benchmark cells' seconds are their result: run --jobs must never put another cell beside them."""
    bench = [c for c in matrix.load_matrix(matrix.MATRIX) if c.axes["suite"] == "benchmarks"]
    assert bench and all(c.options.get("exclusive") is True for c in bench)


#: A child that stops on SIGINT even where it inherited SIGINT ignored (a run started with `&` from a
#: script, as the clean-clone CI run was: the first version of the test below then waited 30 s).
SLEEPER = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); time.sleep(30)"


def test_a_cell_cut_by_the_budget_is_not_finished_and_resume_runs_it_again(tmp_path, monkeypatch):
    """A cell stopped by what was left of the run's budget (shorter than its own timeout) is "cut":
    its record keeps the log, but --resume runs it again; its own timeout firing stays "timeout"."""
    cell = matrix.Cell(dict(zip(matrix.AXES, ("graphs", "-", "-", "-", "-", "-"))), 60.0, 90.0)
    monkeypatch.setattr(matrix, "command", lambda c, w, t=None: [sys.executable, "-c", SLEEPER])
    monkeypatch.setattr(matrix, "summarize", lambda c, w: {})
    cut, wall = matrix.run_cell(cell, 0.5, open(tmp_path / "log", "w"), dict(os.environ))
    assert cut["status"] == "cut" and wall < 20
    own = matrix.Cell(cell.axes, 0.2, 0.5)
    timed_out, _ = matrix.run_cell(own, 0.5, open(tmp_path / "log2", "w"), dict(os.environ))
    assert timed_out["status"] == "timeout"
    # a kernels cell stops itself at the (shorter) time it was given and exits 124: cut as well
    monkeypatch.setattr(matrix, "command", lambda c, w, t=None: [sys.executable, "-c", "raise SystemExit(124)"])
    stopped, _ = matrix.run_cell(cell, 30.0, open(tmp_path / "log3", "w"), dict(os.environ))
    assert stopped["status"] == "cut"
    own_time, _ = matrix.run_cell(cell, cell.timeout_s, open(tmp_path / "log4", "w"), dict(os.environ))
    assert own_time["status"] == "timeout"
    (tmp_path / "r.jsonl").write_text(json.dumps({"cell": cell.id, "status": "cut", "finished": "x"}) + "\n")
    assert matrix.read_records([tmp_path / "r.jsonl"]) == {}


def test_a_kernels_cell_that_stops_itself_at_its_budget_is_a_timeout_not_an_error():
    """kernels_gpu.py interrupts pytest before the cell's timeout and exits 124: the cell did not
    fit its time (kernels:lora was recorded as an "error" with exit 2 on 2026-12-02)."""
    assert matrix._status(124, False) == "timeout"
    assert matrix._status(2, False) == "error" and matrix._status(1, False) == "fail"


def test_a_kernels_cell_given_less_than_its_timeout_interrupts_pytest_before_it(tmp_path):
    """A kernels cell cut by the run's budget must still stop pytest itself in time to report (it was
    given --budget-s 230 with 185 s left on 2026-12-02, and its report was lost)."""
    cell = {c.id: c for c in matrix.load_matrix()}["kernels/-/-/-/-/gpu:expand-loads"]
    own = matrix.command(cell, tmp_path)
    assert own[own.index("--budget-s") + 1] == f"{cell.timeout_s - matrix.KERNELS_REPORT_S:.0f}"
    cut = matrix.command(cell, tmp_path, 185.0)
    assert cut[cut.index("--budget-s") + 1] == f"{185.0 - matrix.KERNELS_REPORT_S:.0f}"


def test_a_record_of_another_definition_of_a_cell_is_stale_and_resume_runs_the_cell_again(tmp_path, monkeypatch):
    """Parts were redefined under the same ids twice on 2026-12-02 (kernels:lora, kernels:fused-lora):
    a record made under another definition (tests, -k, options) neither skips the cell on --resume
    nor stands for it in the report; a change of estimate or scheduling keeps the record."""
    monkeypatch.setattr(matrix, "_versions", lambda: {})
    base = '[[group]]\nsuite = "kernels"\nprofile = "gpu"\nestimate_s = 10\n[group.parts.a]\ntests = ["t1.py"]\n'
    path = tmp_path / "m.toml"
    path.write_text(base)
    (old,) = matrix.load_matrix(path)
    out = tmp_path / "run"
    matrix.run([old], out_dir=out, budget_s=None, resume=[], commit="c",
               runner=lambda c, t, log, env: ({"status": "timeout", "exit_code": None}, 1.0))
    rec = matrix.read_records([out])[old.id]
    assert rec["definition"] == old.definition
    path.write_text(base.replace("estimate_s = 10", "estimate_s = 99\nexclusive = true"))
    (same,) = matrix.load_matrix(path)
    assert same.definition == old.definition and matrix.is_current(same, rec)
    path.write_text(base + 'pytest_k = "not slow"\n')
    (new,) = matrix.load_matrix(path)
    assert new.id == old.id and new.definition != old.definition and not matrix.is_current(new, rec)
    ran = []
    matrix.run([new], out_dir=tmp_path / "run2", budget_s=None, resume=[out], commit="c",
               runner=lambda c, t, log, env: (ran.append(c.id) or {"status": "pass", "exit_code": 0}, 1.0))
    assert ran == [new.id]
    assert [r["status"] for r in matrix.report_rows([new], {new.id: rec})] == ["not-run"]
    legacy = {k: v for k, v in rec.items() if k != "definition"}
    assert matrix.is_current(new, legacy)


def test_running_out_of_gpu_memory_beside_other_cells_is_not_a_finding(tmp_path):
    """Run 7 on 2026-12-02 (8 conformance cells at once) recorded a fail and a timeout whose failures
    were CUDA OOM while other suites held the memory: such records count as not run; the same
    failure with the GPU to itself (jobs 1) stays a fail."""
    oom = "test_x[prefill-full-fp16]: OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB."
    recs = [{"cell": "a", "status": "fail", "jobs": 8, "failures": [oom], "finished": "1"},
            {"cell": "b", "status": "timeout", "jobs": 8, "failures": ["t: AssertionError", oom], "finished": "1"},
            {"cell": "c", "status": "fail", "jobs": 1, "failures": [oom], "finished": "1"},
            {"cell": "d", "status": "fail", "jobs": 8, "failures": ["t: AssertionError: wrong rows"], "finished": "1"},
            {"cell": "e", "status": "fail", "failures": [oom], "finished": "1"}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert sorted(matrix.read_records([path])) == ["c", "d", "e"]


def test_run_started_with_sigint_ignored_lets_its_cells_see_the_interrupt(tmp_path):
    """`matrix.py run` started in the background has SIGINT ignored, and its cells would inherit
    that: it restores the default so a cell's timeout interrupt stops pytest, which then reports."""
    import subprocess

    (tmp_path / "m.toml").write_text('[[group]]\nsuite = "graphs"\nestimate_s = 1\n')
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "sys.path.insert(0, 'ci/gpu')\n"
            "import matrix\n"
            f"matrix.main(['--matrix', {str(tmp_path / 'm.toml')!r}, 'run', '--budget-s', '0', "
            f"'--out-dir', {str(tmp_path / 'out')!r}])\n"
            "print('ignored' if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 'restored')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "restored", out.stderr


def test_a_tree_that_differs_from_git_head_is_recorded_as_dirty(tmp_path, monkeypatch):
    # a GPU host's copy of the working tree carried git metadata one commit behind the code that
    # ran (H200, 2026-12-04): HEAD alone named the wrong commit, so a changed tracked file says so
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.py").write_text("a = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "f.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "one"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.delenv("MOELORA_COMMIT", raising=False)
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    assert matrix._commit(None) == head
    (tmp_path / "untracked.txt").write_text("scratch\n")
    assert matrix._commit(None) == head, "an untracked file is not a change to the code"
    (tmp_path / "f.py").write_text("a = 2\n")
    assert matrix._commit(None) == f"{head}-dirty"
    assert matrix._commit("given") == "given"
    monkeypatch.setenv("MOELORA_COMMIT", "from-env")
    assert matrix._commit(None) == "from-env"
