"""``moelora-conformance``: the subcommand registry and ``hf-check``'s table and exit status.

hf-check exits 0 with a table of model × adapter × max relative error when everything passes, and
1 when a check fails (here: a manifest that expects another σ than peft's); a directory without a
manifest is a clear error (exit 2), not a traceback, for hf-check and checkpoint-pass alike; the
registry lives in ``commands`` (``cli`` and the subcommand modules import it: no import circle).
"""

import argparse
import json
import shutil

import pytest

from moelora_conformance import cli, commands


def test_registry_holds_the_builtin_subcommands_and_refuses_duplicates():
    assert {"make-fixtures", "hf-check"} <= set(cli.SUBCOMMANDS)
    parser, handlers = cli.build_parser()
    assert set(handlers) == set(cli.SUBCOMMANDS)
    with pytest.raises(ValueError, match="already registered"):
        cli.subcommand("hf-check", help="again")(lambda parser: (lambda args: 0))
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a subcommand is required


def test_a_new_subcommand_plugs_in(monkeypatch):
    monkeypatch.setattr(commands, "SUBCOMMANDS", dict(commands.SUBCOMMANDS))

    @cli.subcommand("echo", help="test only")
    def _echo(parser: argparse.ArgumentParser):
        parser.add_argument("--code", type=int, default=3)
        return lambda args: args.code

    assert cli.main(["echo", "--code", "7"]) == 7


def test_hf_check_passes_and_prints_the_table(fixture_set, capsys):
    status = cli.main(["hf-check", "--fixtures", str(fixture_set.root), "--only-adapter", "mixtral-legacy",
                       "--only-adapter", "qwen3_moe_h2i-r8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "oracle vs HF transformers + PEFT" in out and "max rel err" in out
    assert "mixtral-legacy" in out and "qwen3_moe_h2i-r8" in out and "(base)" in out
    assert "FAIL" not in out and "all pass" in out


def test_hf_check_fails_with_nonzero_status(fixture_set, tmp_path, capsys):
    root = tmp_path / "fixtures"
    shutil.copytree(fixture_set.root, root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["adapters"]["olmoe-r8"]["modules"]["1"]["down"]["scaling"] *= 2  # expect a σ peft never used
    (root / "manifest.json").write_text(json.dumps(manifest))
    status = cli.main(["hf-check", "--fixtures", str(root), "--only-adapter", "olmoe-r8"])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL" in out and "L1 down" in out


@pytest.mark.parametrize("command", ["hf-check", "checkpoint-pass"])
def test_a_fixtures_directory_without_a_manifest_is_a_clear_error(command, tmp_path, capsys):
    pytest.importorskip("peft")
    (tmp_path / "models").mkdir()
    extra = ["--backends", "reference"] if command == "checkpoint-pass" else []
    assert cli.main([command, "--fixtures", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert "is not a fixtures directory: it has no manifest.json" in err and "make-fixtures" in err
    assert "Traceback" not in err


def test_subcommand_modules_do_not_import_the_cli():
    import ast
    import inspect

    from moelora_conformance.checkpoint_pass import command

    imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(command))) if isinstance(n, ast.ImportFrom)}
    assert "moelora_conformance.cli" not in imported and "moelora_conformance.commands" in imported


def test_make_fixtures_refuses_an_unknown_opt_in_family_before_writing(tmp_path, capsys):
    out = tmp_path / "fixtures"
    assert cli.main(["make-fixtures", str(out), "--families", "qwen2_moe_fp8,bogus"]) == 2
    err = capsys.readouterr().err
    assert "--families" in err and "bogus" in err and "qwen2_moe_fp8" in err, err
    assert not out.exists()
