"""The pytest plugin, run as a user runs it (a subprocess per case, small example budgets).

Covers: with no path argument the suite's own property modules are collected from any directory,
one item per property × mode × dtype; the header echoes backend, version, capabilities and every
``MOELORA_*`` variable; no backend is a usage error; a backend that declares less gets "not
implemented" skips (never failures) and is never handed virtual experts it does not declare; the
explicit ``--max-examples`` reaches every item even where a conftest loads another profile; a
failure carries a repro whose replay command reproduces it, and so does the rerun command.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelora_conformance.faulty import target
from moelora_conformance.properties.registry import PROPERTIES
from moelora_conformance.session import run_suite, suite_command
from moelora_core import Capabilities
from moelora_reference.backend import ReferenceBackend

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ITEMS_ON_CPU = sum(len(p.modes) for p in PROPERTIES.values()) * 2  # fp32, fp16


class LimitedBackend(ReferenceBackend):
    """The reference declaring fp32 only, the prefill family in ``full`` mode only, no virtual experts,
    no fused MoE; it refuses a spec that asks for virtual experts."""

    name = "limited"

    def __init__(self, spec):
        if spec.virtual_experts:
            raise AssertionError("the suite asked for virtual experts the backend does not declare")
        super().__init__(spec)

    def capabilities(self):
        return Capabilities(dtypes=frozenset({torch.float32}), graph_families=frozenset({"prefill"}),
                            prefill_graph_modes=frozenset({"full"}))


def make_limited(spec):
    return LimitedBackend(spec)


def _env():
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "TRITON_INTERPRET": "1"}


def test_collects_its_own_properties_from_any_directory_and_echoes_the_header(tmp_path):
    run = run_suite("reference", profile="interpret", cwd=tmp_path, env={"MOELORA_NOTE": "visible-in-header"},
                    extra=["--co", "-v"])  # -v cancels the runner's -q: the header is printed
    assert run.returncode == 0, run.output[-3000:]
    out = run.output
    assert f"collected {ITEMS_ON_CPU} items" in out
    assert "backend reference" in out and '"virtual_experts": true' in out
    assert "MOELORA_NOTE=visible-in-header" in out
    assert "profile: interpret" in out


def test_no_backend_is_a_usage_error(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-p", "moelora_conformance.plugin", "-p", "no:cacheprovider", "--co"]
    env = {k: v for k, v in os.environ.items() if k != "MOELORA_BACKEND"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "--backend" in proc.stderr


@pytest.mark.slow
def test_undeclared_capabilities_are_not_implemented(tmp_path):
    run = run_suite("test_plugin:make_limited", profile="interpret", env=_env(), max_examples=2,
                    extra=["-k", "test_every_output_row or test_virtual_experts or test_static_buffers"])
    assert run.returncode == 0, run.output[-4000:]
    outcome = {(r["property"], r["mode"], r["dtype"]): (r["outcome"], r["reason"]) for r in run.report["records"]}
    assert outcome[("P01", "eager", "fp32")][0] == "passed"
    assert outcome[("P01", "prefill-full", "fp32")][0] == "passed"
    assert outcome[("P01", "eager", "fp16")] == ("not_implemented", "not implemented: dtype fp16")
    assert outcome[("P01", "decode", "fp32")] == ("not_implemented", "not implemented: decode graph family")
    assert outcome[("P01", "prefill-breakable", "fp32")] == ("not_implemented",
                                                            "not implemented: prefill graph mode breakable")
    assert outcome[("P10", "eager", "fp32")] == ("not_implemented", "not implemented: virtual experts")
    assert outcome[("P06", "prefill", "fp32")][0] == "passed"
    assert {o for o, _ in outcome.values()} == {"passed", "not_implemented"}


@pytest.mark.slow
def test_max_examples_reaches_every_item_despite_a_conftest_profile():
    # From the repository root, whose conftest.py loads $MOELORA_PROFILE while pytest collects.
    run = run_suite("reference", profile="interpret", cwd=REPO, max_examples=3, env={"MOELORA_PROFILE": "dev"},
                    extra=["-k", "test_metadata_is_exact and eager"])
    assert run.returncode == 0, run.output[-4000:]
    assert {r["max_examples"] for r in run.report["records"]} == {3}


def _pytest_argv(command: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a repro line: leading ``NAME=value`` words set the environment."""
    argv = shlex.split(command)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    assert argv and argv[0] == "pytest", command
    return [sys.executable, "-m", *argv], env


@pytest.mark.slow
def test_a_failure_carries_a_repro_that_replays_it(tmp_path):
    run = run_suite(target("host-sync"), profile="interpret", max_examples=3, no_shrink=True,
                    extra=["-k", "test_every_output_row_equals_the_oracle and decode-fp32"])
    assert run.returncode == 1, run.output[-4000:]
    (rec,) = run.report["records"]
    assert rec["outcome"] == "failed" and rec["message"].startswith("HostSyncError")
    repro = rec["repro"]
    assert repro["trace"][0].startswith("case: seed=") and "moelora repro for" in run.output
    for key in ("replay", "rerun"):
        argv, env = _pytest_argv(repro[key])
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, f"{key}: {out[-3000:]}"
        assert "1 failed" in out and "HostSyncError" in out, f"{key}: {out[-3000:]}"


def test_suite_command_carries_every_option(tmp_path):
    cmd = suite_command("b:f", profile="gpu", report_json=tmp_path / "r.json", device="cuda", manifest="m.toml",
                        junitxml="j.xml", max_examples=7, no_shrink=True, exitfirst=True, hypothesis_seed=5, workers=2,
                        extra=["-k", "P01"])
    text = " ".join(cmd)
    for part in ("--backend b:f", "--profile gpu", "--device cuda", "--manifest m.toml", "--junitxml=j.xml",
                 "--max-examples 7", "--no-shrink", " -x", "--hypothesis-seed=5", "-n 2", "-k P01"):
        assert part in text, part
