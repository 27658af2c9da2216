"""A new user's e2e run: their own checkpoint and the adapters peft writes for them, with their own
options — what the report claims, and that its rerun lines rerun it (``docs/suite.md``, "Statuses",
"Reruns").

- ``test_user_run_reports_only_what_ran_and_its_reruns_rerun``: two peft adapters made the way users make
  them (``target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]``, saved with the short
  ``target_parameters`` names) — one trained (random factors), one with peft's default init (a no-op) —
  and ``--requests 16``: the no-op adapter is named at load, E05 is ``partial`` with each item met / not met
  (16 requests, one effective rank) and listed under "Not proven" with them, every ``not run`` says why,
  the run exits 0 (1 with ``--require-coverage``, as does ``report --require-coverage``), and a record's
  rerun line, pasted, reproduces its run (the same records).
- ``test_claims_on_no_op_adapters_only_are_not_meaningful``: only no-op adapters: E02 is ``not meaningful``
  with the reason, ``--require-coverage`` fails the run.
- ``test_e06_rerun_is_a_command``: the state machine's rerun line is a ``moelora-conformance e2e`` command,
  and it reproduces E06.
"""

from __future__ import annotations

import shlex
import shutil
import warnings

import pytest

from moelora_conformance.cli import main
from moelora_conformance.report import load_report, matrix_markdown

MODEL = "qwen3_moe"
USER = ["--backend", "reference", "--requests", "16", "--max-new-tokens", "2", "--max-prompt-tokens", "24",
        "--state-machine-examples", "0"]

pytestmark = pytest.mark.xdist_group("e2e-reference")


@pytest.fixture(scope="module")
def user_files(tmp_path_factory, fixture_set):
    """(model dir, {"naive": trained adapter, "noop": default-init adapter}) made with peft as users do."""
    import torch
    from peft import LoraConfig, get_peft_model

    from moelora_conformance.hf_check.hf_model import load_hf

    root = tmp_path_factory.mktemp("user-adapters")
    model_dir = fixture_set.model_dir(MODEL)
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    for name, init in (("naive", False), ("noop", True)):
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            torch.manual_seed(1)
            model = get_peft_model(load_hf(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                                  init_lora_weights=init))
            if not init:  # visible deltas (peft's random init of B is tiny next to the base)
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if "lora_B" in n:
                            p.copy_(torch.randn_like(p) * 0.05)
        model.save_pretrained(str(root / name))
    return model_dir, {"naive": root / "naive", "noop": root / "noop"}


def _records(path, modes=None):
    return {(r["property"], r["mode"]): r for r in load_report(path)["records"] if modes is None or r["mode"] in modes}


def test_user_run_reports_only_what_ran_and_its_reruns_rerun(user_files, tmp_path, capsys):
    model_dir, adapters = user_files
    out, md = tmp_path / "user.json", tmp_path / "user.md"
    argv = ["e2e", *USER, "--model", str(model_dir), *(f"--adapter={n}={p}" for n, p in adapters.items()),
            "--modes", "eager,full", "--json", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: adapter 'noop' is a no-op: lora_B is exactly zero" in err
    records = _records(out)
    for mode in ("eager", "full"):
        e05 = records[("E05", mode)]
        assert e05["outcome"] == "partial", e05
        assert e05["coverage"]["requests"] == "not met (16 requests)"
        assert e05["coverage"]["ranks"] == "not met (ranks [16]; no-op adapters ['noop'] do not count)"
        assert e05["coverage"]["base"] == e05["coverage"]["mixed"] == "met"
        assert records[("E02", mode)]["outcome"] == "passed"  # the trained adapter makes it meaningful
    assert all(r["reason"] for r in records.values() if r["outcome"] == "not_run")
    text = md.read_text()
    assert "## Not proven" in text
    for mode in ("eager", "full"):  # (the graph items make the two modes' states differ)
        assert f"E05 [{mode}; fp32; qwen3_moe] partial: not met: 64 ragged requests (16 requests); " in text
    assert "met: base requests, prefills and decodes in one step" in text and "## Adapter warnings" in text
    assert "| E01 " in text and "decode_graph" not in text.split("## Not proven")[0]  # modes not asked for
    assert ("E04", "full") not in records or records[("E04", "full")]["outcome"] != "not_run" or \
        ("## Not run" in text and "no step of this run was beyond the captured capacity" in text)
    assert main(["report", str(out)]) == 0
    assert main(["report", str(out), "--require-coverage"]) == 1
    # the rerun line of full mode's E05, pasted: the same records of that mode
    rerun = records[("E05", "full")]["repro"]["rerun"]
    assert "--requests 16" in rerun and "--max-prompt-tokens 24" in rerun and "--modes full" in rerun
    assert str(model_dir.resolve()) in rerun and "/tmp/moelora-e2e-" not in rerun
    again = tmp_path / "again.json"
    args = shlex.split(rerun)
    assert args[:2] == ["moelora-conformance", "e2e"]
    assert main([*args[1:], "--json", str(again)]) == 0
    first, second = _records(out, {"full"}), _records(again, {"full"})
    assert set(first) == set(second)
    for key, rec in first.items():
        assert (second[key]["outcome"], second[key]["coverage"]) == (rec["outcome"], rec["coverage"]), key
        assert second[key]["repro"] == rec["repro"], key
    assert second[("E05", "full")]["details"]["prompt_tokens"] == first[("E05", "full")]["details"]["prompt_tokens"]


def test_claims_on_no_op_adapters_only_are_not_meaningful(user_files, tmp_path, capsys):
    model_dir, adapters = user_files
    twin = tmp_path / "noop2"
    shutil.copytree(adapters["noop"], twin)
    out = tmp_path / "noop.json"
    argv = ["e2e", *USER, "--model", str(model_dir), f"--adapter=a={adapters['noop']}", f"--adapter=b={twin}",
            "--requests", "6", "--modes", "eager", "--properties", "E02,E05", "--json", str(out)]
    assert main([*argv, "--require-coverage"]) == 1
    assert "--require-coverage: claims not proven" in capsys.readouterr().err
    records = _records(out)
    assert set(records) == {("E02", "eager"), ("E05", "eager")}
    e02 = records[("E02", "eager")]
    assert e02["outcome"] == "not_meaningful" and e02["reason"].startswith("every adapter it used is a no-op (a: ")
    assert "held for the base model only" in e02["reason"]
    assert "E02 [eager; fp32; qwen3_moe] not meaningful: every adapter it used is a no-op" in matrix_markdown(
        [load_report(out)])
    assert main(["report", str(out)]) == 0


def test_e06_rerun_is_a_command(user_files, tmp_path):
    model_dir, adapters = user_files
    out, again = tmp_path / "e06.json", tmp_path / "again.json"
    argv = ["e2e", *USER, "--model", str(model_dir), *(f"--adapter={n}={p}" for n, p in adapters.items()),
            "--properties", "E06", "--state-machine-examples", "2", "--json", str(out)]
    assert main(argv) == 0
    (rec,) = load_report(out)["records"]
    rerun = rec["repro"]["rerun"]
    assert rec["property"] == "E06" and rec["outcome"] == "passed", rec
    assert rerun.startswith("moelora-conformance e2e --backend reference --model ") and "--properties E06" in rerun
    assert "--state-machine-examples 2" in rerun and "run_state_machine(" not in rerun
    assert main([*shlex.split(rerun)[1:], "--json", str(again)]) == 0
    (rec2,) = load_report(again)["records"]
    assert (rec2["property"], rec2["outcome"], rec2["details"]["examples"]) == ("E06", "passed",
                                                                                  rec["details"]["examples"])
