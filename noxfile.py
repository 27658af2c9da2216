"""moelora's single entry point. Sessions (see README.md):

    nox -s lint          ruff over the repository
    nox -s tests         everything that runs on a CPU (the README's test command; what .ci/run calls)
    nox -s conformance   the main job: the conformance run of the built-in backends on the CPU
    nox -s e2e           the e2e suite on the engine (CI-sized) over the built-in backends

Sessions that install torch use venv + pip with the constraints file ci/constraints/cpu.txt, so
no transitive requirement can pull a CUDA build of torch. Kernels run under the Triton interpreter
(TRITON_INTERPRET=1, set before anything imports triton).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ROOT / "ci" / "constraints" / "cpu.txt"
REPORTS = ROOT / ".reports"

# In dependency order; a package takes part once its pyproject.toml exists.
PACKAGES = ["packages/core", "reference", "packages/kernels", "packages/backends", "packages/runner", "conformance"]
# Extras installed for CPU sessions (the fixtures builder needs transformers + peft; the tests of
# reference, kernels and backends draw with the conformance strategies: their "test" extra).
EXTRAS = {"conformance": "[fixtures]", "reference": "[test]", "packages/kernels": "[test]",
          "packages/backends": "[test]"}
TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100"]

CPU_ENV = {
    "TRITON_INTERPRET": "1",
    "MOELORA_PROFILE": os.environ.get("MOELORA_PROFILE", "interpret"),
    # Two CPU cores: one torch thread per xdist worker avoids oversubscription.
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    # CI=true would make Hypothesis load its built-in "ci" profile; ours are loaded by name.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]


def _packages() -> list[str]:
    return [p for p in PACKAGES if (ROOT / p / "pyproject.toml").exists()]


def _install_moelora(session: nox.Session) -> None:
    """torch (CPU wheel) + every moelora package, editable, under the CPU constraints."""
    session.install("--upgrade", "pip")
    session.install("-c", str(CONSTRAINTS), "torch==2.13.0", "hatchling>=1.24", "editables", *TEST_TOOLS)
    editables = []
    for pkg in _packages():
        editables += ["-e", f"./{pkg}{EXTRAS.get(pkg, '')}"]
    # No build isolation: hatchling is already in the venv, and six isolated builds would each
    # resolve it again.
    session.install("-c", str(CONSTRAINTS), "--no-build-isolation", *editables)


def _test_paths() -> list[str]:
    paths = [f"{p}/tests" for p in _packages() if (ROOT / p / "tests").is_dir()]
    paths += [p for p in ("e2e", "ci/tests") if (ROOT / p).is_dir()]
    return paths


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """Every CPU test: unit tests of each package, kernels under the interpreter, graph paths on the
    emulator, and the conformance suite once over the built-in backends (interpret profile).

    Extra arguments go to pytest (``nox -s tests -- -k align``).
    """
    _install_moelora(session)
    REPORTS.mkdir(exist_ok=True)
    junit = REPORTS / "tests-junit.xml"
    args = session.posargs or ["-n", "2", "--dist", "loadgroup"]
    session.run(
        "python", "-m", "pytest", *_test_paths(), f"--junitxml={junit}", *args,
        env=CPU_ENV,
    )
    session.log(f"JUnit report: {junit}")


@nox.session
def conformance(session: nox.Session) -> None:
    """The main job: the conformance run of the built-in backends on the CPU, on real tiny MoE
    checkpoints with real PEFT adapters built locally.

    1. Build the fixtures (tiny Qwen3-MoE / Mixtral / OLMoE checkpoints and PEFT adapters, made
       locally with transformers + peft) and check the oracle, the checkpoint readers and the
       reference backend against HF+PEFT on every model x adapter.
    2. Run the conformance suite (interpret profile) on reference, triton and csgmv (Triton kernels
       under the interpreter) and print the support matrix.
    3. The real-checkpoint pass: every fixture model, >32-request mixed batches, every backend x
       {eager, decode graph, prefill full, prefill breakable} against the oracle and HF+PEFT.
    4. A CI-sized e2e pass on the engine (``nox -s e2e``'s default) and its support matrix.

    Exits non-zero on any unexpected failure. Reports land in .reports/. Extra arguments go to
    ``moelora-conformance run`` (e.g. ``nox -s conformance -- --profile dev``).
    """
    _install_moelora(session)
    REPORTS.mkdir(exist_ok=True)
    fixtures = ROOT / "fixtures-cache"
    session.run("moelora-conformance", "make-fixtures", str(fixtures), env=CPU_ENV)
    session.run("moelora-conformance", "hf-check", "--fixtures", str(fixtures), env=CPU_ENV)
    run_args = session.posargs or ["--profile", "interpret", "--max-examples", "triton=2", "--max-examples", "csgmv=2"]
    session.run(
        "moelora-conformance", "run", "--backend", "reference", "--backend", "triton", "--backend", "csgmv",
        "-n", "2", "--json", str(REPORTS / "conformance.json"), "--junitxml", str(REPORTS / "conformance.xml"),
        "--markdown", str(REPORTS / "support-matrix.md"), *run_args, env=CPU_ENV,
    )
    session.run(
        "moelora-conformance", "checkpoint-pass", "--fixtures", str(fixtures),
        "--backends", "reference,triton,csgmv", "--json", str(REPORTS / "checkpoint-pass.json"), env=CPU_ENV,
    )
    _run_e2e(session, fixtures, [])
    session.log(f"reports in {REPORTS}: conformance-<backend>.json/.xml, support-matrix.md, checkpoint-pass.json, "
                "e2e-<backend>.json, e2e-matrix.md")


#: The built-in backends of the e2e pass.
E2E_BACKENDS = ["reference", "triton", "csgmv"]


def _run_e2e(session: nox.Session, fixtures: Path, args: list[str]) -> None:
    """``moelora-conformance e2e`` on the fixtures: CI-sized by default (every fixture family with
    reference, one per kernel backend; 64 requests, 8 new tokens, the state machine at 20 examples);
    ``args`` replace the backends and options."""
    backends = [] if any(a.startswith("--backend") for a in args) else [f"--backend={b}" for b in E2E_BACKENDS]
    session.run(
        "moelora-conformance", "e2e", "--fixtures", str(fixtures), *backends, "--json", str(REPORTS / "e2e.json"),
        "--markdown", str(REPORTS / "e2e-matrix.md"), *args, env=CPU_ENV,
    )


@nox.session
def e2e(session: nox.Session) -> None:
    """The e2e suite on the engine: every built-in backend x {eager, decode graph, prefill full,
    prefill breakable} over the CI-sized ragged mixed workload, graph vs eager, vs HF + PEFT, the
    metrics proving which path ran, and the stateful engine properties; prints the support matrix.

    Builds the fixtures first. Extra arguments go to ``moelora-conformance e2e`` (e.g.
    ``nox -s e2e -- --backend my_pkg.mod:make_backend --model DIR --adapter a=DIR --adapter b=DIR``).
    """
    _install_moelora(session)
    REPORTS.mkdir(exist_ok=True)
    fixtures = ROOT / "fixtures-cache"
    session.run("moelora-conformance", "make-fixtures", str(fixtures), env=CPU_ENV)
    _run_e2e(session, fixtures, list(session.posargs))
    session.log(f"reports in {REPORTS}: e2e-<backend>.json, e2e-matrix.md")


@nox.session
def peers(session: nox.Session) -> None:
    """The field's own code through the suite: SGLang 0.5.23's MoE-LoRA paths (legacy, virtual
    experts, grouped) and vLLM 0.34.0's fused path as backends (packages/peers), each through the
    layer suite (interpret profile, 1 example per item, a fixed Hypothesis seed, no shrinking) with
    its expected-failure manifest (packages/peers/manifests, each entry citing
    conformance/docs/peers.md). The peers are installed with ``--no-deps`` (their metadata pins a
    torch that ci/constraints/cpu.txt forbids); their small dependencies come from
    ci/constraints/peers.txt. Writes .reports/peers.json (one record per cell) and
    .reports/peers-matrix.md; red on an unexpected failure, a stale manifest entry or a refused path.

    Extra arguments go to ``python -m moelora_peers.grid run`` (``nox -s peers -- --path sglang:legacy``).
    """
    peers_constraints = ROOT / "ci" / "constraints" / "peers.txt"
    _install_moelora(session)
    session.install("-c", str(CONSTRAINTS), "-c", str(peers_constraints), "--no-deps", "sglang", "vllm")
    session.install("-c", str(CONSTRAINTS), "-c", str(peers_constraints), "msgspec", "pydantic")
    session.install("-c", str(CONSTRAINTS), "--no-deps", "--no-build-isolation", "-e", "./packages/peers[test]")
    REPORTS.mkdir(exist_ok=True)
    session.run("python", "-m", "pytest", "packages/peers/tests", "-q", "-p", "no:cacheprovider", env=CPU_ENV)
    session.run("python", "-m", "moelora_peers.grid", "run", "--out", str(REPORTS), *session.posargs, env=CPU_ENV)
