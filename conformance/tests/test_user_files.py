"""``hf-check`` and ``checkpoint-pass`` on a user's own files (``--model DIR --adapter NAME=DIR``,
``moelora_conformance.user_files``).

Covers: what each adapter must mean is read from its files and equals what the fixtures builder
recorded when it made them (peft's in-memory ranks and σ for fused adapters — rsLoRA and patterns
included —, the per-module formula for legacy ones, legacy + rsLoRA marked divergent); both commands
pass on a fixture model given as a user's directory; every directory that is not a checkpoint or an
adapter, a malformed ``--adapter``, ``--adapter`` without ``--model`` and ``--model`` with
``--fixtures`` are usage errors (exit 2) whose message names what is missing, never a traceback; a
no-op adapter (peft's default init) is named at load and its checks are "not meaningful" (exit 0;
exit 1 with ``--require-coverage``), in hf-check's table and in checkpoint-pass's cells.
"""

import math
import shutil

import pytest

from moelora_conformance import cli
from moelora_conformance.user_files import user_fixture_set

pytest.importorskip("peft")

MODEL = "qwen3_moe"


def _fixture_adapters(fixture_set):
    return {n: fixture_set.adapter_dir(n) for n, e in sorted(fixture_set.manifest["adapters"].items())
            if e["model"] == MODEL}


def test_expected_ranks_and_sigmas_come_from_the_files(fixture_set):
    adapters = _fixture_adapters(fixture_set)
    user = user_fixture_set(fixture_set.model_dir(MODEL), adapters)
    assert set(user.manifest["adapters"]) == set(adapters) and len(adapters) >= 5
    for name, entry in user.manifest["adapters"].items():
        recorded = fixture_set.adapter(name)
        assert entry["format"] == recorded["format"] and entry["peft_divergent"] == recorded["peft_divergent"], name
        assert entry["modules"].keys() == recorded["modules"].keys(), name
        for layer, modules in recorded["modules"].items():
            assert entry["modules"][layer].keys() == modules.keys(), (name, layer)
            for module, want in modules.items():
                got = entry["modules"][layer][module]
                assert got["rank"] == want["rank"] and math.isclose(got["scaling"], want["scaling"], rel_tol=1e-12), \
                    (name, layer, module, got, want)


def test_hf_check_and_the_pass_run_on_a_users_directories(fixture_set, tmp_path, capsys):
    model = str(fixture_set.model_dir(MODEL))
    adapters = [f"mine={fixture_set.adapter_dir('qwen3_moe-rslora')}",
                f"old={fixture_set.adapter_dir('qwen3_moe-legacy')}"]
    args = ["--model", model, *[a for x in adapters for a in ("--adapter", x)]]
    assert cli.main(["hf-check", *args]) == 0
    out = capsys.readouterr().out
    assert "mine" in out and "old" in out and "all pass" in out
    assert cli.main(["checkpoint-pass", *args, "--backends", "reference", "--modes", "eager", "--layers", "0",
                     "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "all pass" in out and "FAIL" not in out


def test_a_noop_adapter_is_named_and_its_checks_are_not_meaningful(fixture_set, tmp_path, capsys):
    import warnings

    from peft import LoraConfig, get_peft_model

    from moelora_conformance.hf_check.hf_model import load_hf

    model = fixture_set.model_dir(MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_peft_model(load_hf(model), LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj",
                                                                       "down_proj"])).save_pretrained(str(tmp_path / "d"))
    args = ["hf-check", "--model", str(model), "--adapter", f"silent={tmp_path / 'd'}"]
    assert cli.main(args) == 0
    out, err = (" ".join(t.split()) for t in capsys.readouterr())
    assert "hf-check: warning: adapter 'silent' is a no-op: lora_B is exactly zero" in err
    assert "not meaningful" in out and "not proven: 1 not meaningful (silent)" in out
    assert cli.main([*args, "--require-coverage"]) == 1


def test_checkpoint_pass_cells_of_noop_adapters_only_are_not_meaningful():
    from moelora_conformance.checkpoint_pass.run import PassRow
    from moelora_conformance.checkpoint_pass.table import summarize

    def row(subject, mode):
        return PassRow("m", "reference", mode, 0, "extend", "hf", subject, "moe", 1e-7, 1e-7, True, "")

    rows = [row("silent", "eager"), row("(base)", "eager"), row("silent", "decode"), row("mine", "decode")]
    cells = {s["mode"]: s for s in summarize(rows, {"silent": "lora_B is exactly zero (8 of 8 modules)"})}
    assert cells["eager"]["noop"] and cells["eager"]["ok"] and "not meaningful" in cells["eager"]["notes"][-1]
    assert not cells["decode"]["noop"]  # another adapter was compared there too


def _not_a_model(tmp_path, fixture_set):
    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"x")
    return ["--model", str(d), "--adapter", f"a={fixture_set.adapter_dir('qwen3_moe-r8')}"], \
        ["is not a Hugging Face checkpoint", "config.json", "pytorch_model.bin not read"]


def _not_an_adapter(tmp_path, fixture_set):
    d = tmp_path / "half-adapter"
    shutil.copytree(fixture_set.adapter_dir("qwen3_moe-r8"), d)
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    return ["--model", str(fixture_set.model_dir(MODEL)), "--adapter", f"a={d}"], \
        ["is not a PEFT adapter", "adapter_model.safetensors", "adapter_model.bin is not read"]


def _refused_adapter(tmp_path, fixture_set):
    bad = next(n for n, e in fixture_set.manifest["bad_adapters"].items() if e["model"] == MODEL)
    return ["--model", str(fixture_set.model_dir(MODEL)), "--adapter", f"a={fixture_set.bad_adapter_dir(bad)}"], \
        ["refused by moelora's adapter reader"]


def _no_equals(tmp_path, fixture_set):
    return ["--model", str(fixture_set.model_dir(MODEL)), "--adapter", "just-a-name"], ["expected NAME=DIR"]


def _adapter_without_model(tmp_path, fixture_set):
    return ["--adapter", f"a={fixture_set.adapter_dir('qwen3_moe-r8')}"], ["needs --model DIR", "--only-adapter"]


def _both_sources(tmp_path, fixture_set):
    return ["--fixtures", str(fixture_set.root), "--model", str(fixture_set.model_dir(MODEL)), "--adapter",
            f"a={fixture_set.adapter_dir('qwen3_moe-r8')}"], ["either --fixtures or --model"]


@pytest.mark.parametrize("command", ["hf-check", "checkpoint-pass"])
@pytest.mark.parametrize("case", [_not_a_model, _not_an_adapter, _refused_adapter, _no_equals, _adapter_without_model,
                                  _both_sources])
def test_unusable_directories_are_named_usage_errors(command, case, fixture_set, tmp_path, capsys):
    args, wanted = case(tmp_path, fixture_set)
    extra = ["--backends", "reference"] if command == "checkpoint-pass" else []
    assert cli.main([command, *args, *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for text in wanted:
        assert text in err, (text, err)
