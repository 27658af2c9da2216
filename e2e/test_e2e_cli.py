"""``moelora-conformance e2e`` (``moelora_conformance.e2e.command``): exit status 0 / 1 / 2 / 5, the
JSON report the layer suite's ``report`` renders, the manifest's expected failures (and a stale
entry failing the run), anyone's checkpoint through ``--model`` / ``--adapter``, the fixture run's rerun
lines (the family and the fixtures directory, every option), Ctrl-C (exit 130, one line, no traceback).

Each run is a tiny workload (8 requests, prompts up to 16 tokens) on the reference backend or a
faulty one from ``e2e_faults``; the state machine is off (``--state-machine-examples 0``) except in
``test_state_machine_absent_is_not_run``.
"""

from __future__ import annotations

import importlib.util
import json
import shlex

import pytest

from moelora_conformance.cli import main
from moelora_conformance.e2e.properties import STATEFUL
from moelora_conformance.e2e.run import E2EConfig, run_stateful
from moelora_conformance.report import load_report

MODEL = "qwen3_moe"
TINY = ["--requests", "8", "--max-new-tokens", "2", "--max-prompt-tokens", "16", "--state-machine-examples", "0"]

pytestmark = pytest.mark.xdist_group("e2e-reference")


def _argv(fixture_set, engine_adapters, *extra, backend="reference", model=MODEL):
    adapters = [f"--adapter={n}={p}" for n, p in engine_adapters[model].items()]
    return ["e2e", "--backend", backend, "--model", str(fixture_set.model_dir(model)), *adapters, *TINY, *extra]


def test_a_passing_run_exits_0_with_its_report(fixture_set, engine_adapters, tmp_path, capsys):
    out, md = tmp_path / "e2e.json", tmp_path / "matrix.md"
    assert main(_argv(fixture_set, engine_adapters, "--modes", "eager,full", "--json", str(out),
                      "--markdown", str(md))) == 0
    report = load_report(out)
    assert report["suite"] == "e2e" and report["backend"]["target"] == "reference"
    got = {(r["property"], r["mode"]) for r in report["records"]}
    assert {("E01", "full"), ("E02", "eager"), ("E03", "full"), ("E05", "full")} <= got
    text = md.read_text()
    assert text.startswith("# moelora e2e: support matrix") and "| E01 graph replay equals eager" in text
    assert main(["report", str(out)]) == 0 and "E03 every step that fits" in capsys.readouterr().out


def test_a_fault_exits_1_and_the_manifest_expects_it(fixture_set, engine_adapters, tmp_path):
    argv = _argv(fixture_set, engine_adapters, "--modes", "eager,full", backend="e2e_faults:make_graph_delta_backend")
    assert main(argv) == 1
    manifest = tmp_path / "expected.toml"
    manifest.write_text('[[expected_failure]]\nproperty = "E01"\nmode = "full"\nreason = "known graph delta"\n'
                        '[[expected_failure]]\nproperty = "E02"\nmode = "full"\nreason = "the same"\n')
    out = tmp_path / "xfail.json"
    assert main([*argv, "--manifest", str(manifest), "--json", str(out)]) == 0
    outcomes = {(r["property"], r["mode"]): r["outcome"] for r in load_report(out)["records"]}
    assert outcomes[("E01", "full")] == outcomes[("E02", "full")] == "xfailed"
    stale = tmp_path / "stale.toml"
    stale.write_text(manifest.read_text() + '[[expected_failure]]\nproperty = "E02"\nmode = "eager"\n'
                     'reason = "not actually failing"\n')
    assert main([*argv, "--manifest", str(stale)]) == 1  # an expected failure that passed: the manifest is stale


def test_nothing_ran_exits_5(fixture_set, engine_adapters, capsys):
    argv = _argv(fixture_set, engine_adapters, "--modes", "eager", backend="e2e_faults:make_cpu_less_backend")
    assert main(argv) == 5
    assert "nothing ran" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--modes", "eager,cuda"], "--modes: unknown ['cuda']"),
    (["--backend", "no_such_module:make"], "--backend no_such_module:make"),
    (["--adapter", "broken"], "expected NAME=DIR"),
    (["--adapter", "x=/nonexistent"], "not a PEFT adapter directory"),
])
def test_usage_errors_exit_2(extra, message, fixture_set, engine_adapters, capsys):
    assert main([*_argv(fixture_set, engine_adapters), *extra]) == 2
    assert message in capsys.readouterr().err


def test_not_a_checkpoint_or_a_refused_adapter_exits_2(fixture_set, engine_adapters, tmp_path, capsys):
    adapters = [f"--adapter={n}={p}" for n, p in engine_adapters[MODEL].items()]
    assert main(["e2e", "--model", str(tmp_path), *adapters, *TINY]) == 2
    assert "not a Hugging Face checkpoint directory (no config.json)" in capsys.readouterr().err
    assert main(["e2e", "--backend", "reference", "--model", str(fixture_set.model_dir("mixtral")), *adapters,
                 *TINY]) == 2
    assert "ModelMismatchError" in capsys.readouterr().err
    assert main(["e2e", "--adapter", adapters[0].removeprefix("--adapter="), *TINY]) == 2
    assert "--adapter needs --model" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[expected_failure]]\nproperty = "P01"\nreason = "a layer property"\n')
    assert main([*_argv(fixture_set, engine_adapters), "--manifest", str(bad)]) == 2
    assert "unknown property 'P01'" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("moelora_conformance.e2e.stateful") is not None,
                    reason="the state machine is installed: its own tests run it")
def test_state_machine_absent_is_not_run(fixture_set, engine_adapters):
    records = run_stateful("reference", fixture_set.model_dir(MODEL), engine_adapters[MODEL], config=E2EConfig(),
                           max_loras=4, dtype="float32", device="cpu", model_name=MODEL)
    assert [(r.property, r.outcome) for r in records] == [(STATEFUL, "not_run")]
    assert "not available" in records[0].message
    assert json.dumps(records[0].to_record())  # JSON-able, as the report needs


def test_the_fixtures_default_runs_the_chosen_families(fixture_set, tmp_path, capsys):
    out = tmp_path / "fixtures.json"
    argv = ["e2e", "--backend", "reference", "--fixtures", str(fixture_set.root), *TINY, "--modes", "eager"]
    assert main([*argv, "--families", "olmoe", "--json", str(out)]) == 0
    report = load_report(out)
    assert report["models"] == ["olmoe"] and {r["model"] for r in report["records"]} == {"olmoe"}
    # a rerun names the fixtures and the family, never this run's temporary engine adapters
    for r in report["records"]:
        rerun = shlex.split(r["repro"]["rerun"])
        assert rerun[rerun.index("--families") + 1] == "olmoe" and "--model" not in rerun, rerun
        assert rerun[rerun.index("--fixtures") + 1] == str(fixture_set.root.resolve())
        assert rerun[rerun.index("--requests") + 1] == "8" and rerun[rerun.index("--max-prompt-tokens") + 1] == "16"
    assert main([*argv, "--families", "gpt2"]) == 2
    err = capsys.readouterr().err  # the opt-in families are known: DeepSeek-V3 and the fp8 copies
    assert "--families: unknown ['gpt2']" in err and "'deepseek_v3', 'qwen3_moe_fp8', 'mixtral_fp8', 'olmoe_fp8'" in err


def test_a_run_cut_short_leaves_every_finished_claim(fixture_set, engine_adapters, tmp_path):
    """The JSON is written as claims finish: a run stopped in its second mode (here by Ctrl-C after the
    first of that mode's claims) leaves a report with the eager mode's claims and that one, marked
    incomplete; a finished run's report is complete."""
    from moelora_conformance.e2e.command import _write_json
    from moelora_conformance.e2e.suite import run_e2e

    out = tmp_path / "cut.json"
    config = E2EConfig(requests=8, max_new_tokens=2, max_prompt_tokens=16, state_machine_examples=0,
                       modes=("eager", "full"))
    models = [(MODEL, fixture_set.model_dir(MODEL), engine_adapters[MODEL])]

    def stop(record):
        if record.mode == "full":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_e2e("reference", models, config=config, hf=False, progress=stop, write=lambda r: _write_json(out, r))
    cut = load_report(out)
    assert cut["complete"] is False
    got = [(r["property"], r["mode"]) for r in cut["records"]]
    assert got[:2] == [("E05", "eager"), ("E02", "eager")] and len(got) == 3 and got[2][1] == "full", got
    run_e2e("reference", models, config=config, hf=False, write=lambda r: _write_json(out, r))
    whole = load_report(out)
    assert whole["complete"] is True and len(whole["records"]) == 2 + 5


def test_ctrl_c_is_one_line_and_130_with_the_finished_claims(fixture_set, engine_adapters, tmp_path, monkeypatch,
                                                             capsys):
    """Ctrl-C in the second backend's run (``GenerateInterrupted``, as the engine raises it) exits 130 with
    one line naming what each report holds; cut before any claim finished, an earlier run's report at
    the path is removed, never left looking like this run's. The suite itself is replaced: only the
    command's handling is under test (the reports' contents: test_a_run_cut_short_leaves_every_finished_claim)."""
    from moelora_conformance.e2e import suite
    from moelora_runner.errors import GenerateInterrupted

    def cut(backend, models, *, write, **kwargs):
        report = {"backend": {"target": backend}, "complete": False, "records": [{"property": "E05"}]}
        write(report)
        if backend != "reference":
            raise GenerateInterrupted([None])
        write({**report, "complete": True})
        return {**report, "complete": True}

    monkeypatch.setattr(suite, "run_e2e", cut)
    faulty = "e2e_faults:make_graph_delta_backend"
    argv = [*_argv(fixture_set, engine_adapters, "--backend", faulty), "--json", str(tmp_path / "e2e.json")]
    assert main(argv) == 130
    done, partial = tmp_path / "e2e-reference.json", tmp_path / "e2e-e2e_faults-make_graph_delta_backend.json"
    assert json.loads(done.read_text())["complete"] is True and json.loads(partial.read_text())["complete"] is False
    err = capsys.readouterr().err
    assert err.splitlines() == [f"moelora-conformance e2e: interrupted (Ctrl-C); {partial} holds the finished "
                                f"claims (complete: false); {done} is complete"]

    def cut_at_once(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "run_e2e", cut_at_once)
    done.write_text('{"from": "an earlier run"}')
    assert main([*_argv(fixture_set, engine_adapters), "--json", str(done)]) == 130
    assert not done.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"moelora-conformance e2e: interrupted (Ctrl-C); no claim had finished; an earlier run's {done} removed"]


def test_ctrl_c_while_the_command_starts_is_one_line_and_130(monkeypatch, capsys):
    """Before ``e2e``'s own handler runs (the parser's defaults import the engine and torch)."""
    from moelora_conformance import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["e2e", "--backend", "reference"]) == 130
    assert capsys.readouterr().err.splitlines() == ["moelora-conformance: interrupted (Ctrl-C)"]
