"""moelora's single entry point. Sessions (see README.md):

    nox -s lint              ruff over the repository
    nox -s tests             every CPU test that the main job does not run (the README's test command)
    nox -s conformance       the main job: a verdict on the built-in backends in about 7 minutes
    nox -s conformance-full  the main job's long tail: every family x backend x mode
    nox -s e2e               the e2e suite on the engine (CI-sized) over the built-in backends

.ci/run runs ``tests`` and then ``conformance``.

Sessions that install torch use venv + pip with the constraints file ci/constraints/cpu.txt, so
no transitive requirement can pull another torch version (the CPU build itself comes from PyTorch's
CPU index, PIP_EXTRA_INDEX_URL: README.md). Kernels run under the Triton interpreter
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
    """Every CPU test the main job does not run: unit tests of each package, kernels under the
    interpreter against their twins, graph paths on the emulator, the suite's own tests (plugin, report,
    mutants). The conformance suite, e2e and checkpoint pass over the built-in backends are the main
    job's (``nox -s conformance``); .ci/run runs both.

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


#: The main job's conformance run, in fp32, the dtype every known fault is caught in
#: (conformance/docs/mutations.md; conformance-full runs every dtype): reference at the profile's budget
#: in every layer mode; the two kernel backends (Triton under the interpreter, ~30x slower) at 2 examples
#: an item — the kernel mutants' budget in the campaign (faulty/backend_mutants.py KERNEL_MUTANT_BUDGET):
#: 1 misses one of them — in one prefill graph mode each (triton prefill-full, where its faults are caught
#: without P06/P07; csgmv prefill-breakable; as in their e2e checks below), so every mode still runs on
#: each graph family; conformance-full runs both.
MAIN_RUN = ["--profile", "interpret", "--max-examples", "triton=2", "--max-examples", "csgmv=2",
            "--dtypes", "fp32", "--skip-modes", "triton=prefill-breakable", "--skip-modes", "csgmv=prefill-full",
            "--require-coverage"]
#: The main job's engine and checkpoint checks, run two at a time (each is one process on one core), the
#: longest first: name → moelora-conformance arguments ("{fixtures}" and "{reports}" filled in).
MAIN_CHECKS = {
    # the reference backend on Qwen3-MoE, CI-sized (64 requests, every engine mode, E06 at 20): the family
    # every e2e and engine-level mutant is caught on (conformance/docs/mutations.md); every other family x
    # mode is conformance-full's (each family's engine against HF + PEFT is nox -s tests':
    # packages/runner/tests/test_engine_hf_parity.py; its layers against HF + PEFT are the checkpoint pass's)
    "e2e-reference": ["e2e", "--fixtures", "{fixtures}", "--backend", "reference", "--families", "qwen3_moe",
                      "--require-coverage", "--json", "{reports}/e2e-reference.json"],
    # the kernel backends on a 16-request workload, eagerly and in one prefill graph mode each (with the
    # decode graph); prompts up to 56 tokens, chunked by the 48-token budget (first and last chunks on the
    # prefill graph), and 3 prefill-graph request slots, so E04 has a step beyond capacity; every family x
    # mode and E06 in conformance-full. E05 is "partial" there by design (16 requests, not the claim's 64,
    # and no prompt long enough for a middle chunk: listed under "not proven"), so these two do not require
    # coverage
    "e2e-triton": ["e2e", "--fixtures", "{fixtures}", "--backend", "triton", "--families", "qwen3_moe",
                   "--modes", "eager,full", "--requests", "16", "--max-new-tokens", "4", "--max-prompt-tokens", "56",
                   "--max-num-requests", "3", "--state-machine-examples", "0", "--json", "{reports}/e2e-triton.json"],
    "e2e-csgmv": ["e2e", "--fixtures", "{fixtures}", "--backend", "csgmv", "--families", "mixtral",
                  "--modes", "eager,breakable", "--requests", "16", "--max-new-tokens", "4",
                  "--max-prompt-tokens", "56", "--max-num-requests", "3", "--state-machine-examples", "0",
                  "--json", "{reports}/e2e-csgmv.json"],
    # the kernel backends on the H = 2·I model (orientation from the format alone) in every layer mode and on
    # Qwen2-MoE (shared expert through the dense path, q/k/v biases) eagerly, layer 0
    "checkpoint-pass-kernels-h2i": ["checkpoint-pass", "--fixtures", "{fixtures}", "--backends", "triton,csgmv",
                                    "--require-coverage",
                                    "--models", "qwen3_moe_h2i", "--layers", "0",
                                    "--json", "{reports}/checkpoint-pass-kernels-h2i.json"],
    # every fixture model on the reference backend in every layer mode (readers, layout adapters, HF + PEFT),
    # the fp8 block-scaled copies in one family (qwen3_moe_fp8): the Mixtral and OLMoE copies (blocks 8 and 4)
    # are more than half this pass's time and conformance-full's; hf-check below still reads all three
    "checkpoint-pass-reference": ["checkpoint-pass", "--fixtures", "{fixtures}", "--backends", "reference",
                                  "--skip-models", "mixtral_fp8,olmoe_fp8", "--require-coverage",
                                  "--json", "{reports}/checkpoint-pass-reference.json"],
    # the oracle and the checkpoint readers against HF + PEFT on every fixture model x adapter
    "hf-check": ["hf-check", "--fixtures", "{fixtures}", "--require-coverage"],
    "checkpoint-pass-kernels-qwen2": ["checkpoint-pass", "--fixtures", "{fixtures}", "--backends", "triton,csgmv",
                                      "--require-coverage",
                                      "--models", "qwen2_moe", "--layers", "0", "--modes", "eager",
                                      "--json", "{reports}/checkpoint-pass-kernels-qwen2.json"],
}


@nox.session
def conformance(session: nox.Session) -> None:
    """The main job (about 7 minutes on 2 quiet cores from a clean clone: README.md): a verdict on the
    built-in backends, on tiny checkpoints and PEFT adapters made locally.

    1. Build the fixtures (tiny Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GPT-OSS, DeepSeek-V3 checkpoints, fp8
       copies and PEFT adapters, made locally with transformers + peft).
    2. The conformance suite (interpret profile) on reference, triton and csgmv (:data:`MAIN_RUN`: fp32,
       the kernel backends in one prefill graph mode each) and its support matrix: every property in every
       mode.
    3. :data:`MAIN_CHECKS`, two at a time: the oracle and the checkpoint readers against HF + PEFT on every
       model x adapter (``hf-check``), the e2e suite on the engine (every engine mode and claim; Qwen3-MoE
       on reference, one family per kernel backend) and the real-checkpoint pass (every model on reference,
       the fp8 copies in one family; the kernel backends on two models).

    What runs is chosen by what catches faults: every fault of conformance/docs/mutations.md is caught by
    a property and configuration these steps keep. ``nox -s conformance-full`` runs the long tail (every
    family x backend x mode, both dtypes, every fp8 copy). Exits non-zero on any unexpected failure.
    Reports land in .reports/. Extra arguments replace step 2's ``moelora-conformance run`` options (e.g.
    ``nox -s conformance -- --profile dev``).
    """
    _install_moelora(session)
    REPORTS.mkdir(exist_ok=True)
    fixtures = _fixtures(session, hf_check=False)
    _suite(session, session.posargs or MAIN_RUN)
    _checks(session, {name: [a.format(fixtures=fixtures, reports=REPORTS) for a in args]
                      for name, args in MAIN_CHECKS.items()})
    session.run("moelora-conformance", "report", *sorted(str(p) for p in REPORTS.glob("e2e-*.json")),
                "--output", str(REPORTS / "e2e-matrix.md"), env=CPU_ENV, silent=True)
    session.log(f"reports in {REPORTS}: conformance-<backend>.json/.xml, support-matrix.md, "
                "checkpoint-pass-*.json, e2e-<backend>.json, e2e-matrix.md; logs of step 3 in .reports/logs/")


@nox.session(name="conformance-full")
def conformance_full(session: nox.Session) -> None:
    """The long tail of the main job (about an hour on 2 cores): the suite on every backend in every dtype
    (2 examples an item for the kernel backends), the real-checkpoint pass on every model (every fp8 copy
    included) x backend x layer mode, and the CI-sized e2e pass (``nox -s e2e``'s default: every family on
    reference, one per kernel backend, every engine mode, E06). Run it before a change is called done."""
    _install_moelora(session)
    REPORTS.mkdir(exist_ok=True)
    fixtures = _fixtures(session)
    _suite(session, session.posargs or ["--profile", "interpret", "--max-examples", "triton=2",
                                        "--max-examples", "csgmv=2"])
    session.run(
        "moelora-conformance", "checkpoint-pass", "--fixtures", str(fixtures),
        "--backends", "reference,triton,csgmv", "--json", str(REPORTS / "checkpoint-pass.json"), env=CPU_ENV,
    )
    _run_e2e(session, fixtures, [])


def _fixtures(session: nox.Session, hf_check: bool = True) -> Path:
    """Build (or reuse) the fixtures and (``hf_check``) check the oracle and readers against HF + PEFT on
    them (the main job runs that check among :data:`MAIN_CHECKS` instead, beside the others)."""
    fixtures = ROOT / "fixtures-cache"
    session.run("moelora-conformance", "make-fixtures", str(fixtures), env=CPU_ENV)
    if hf_check:
        session.run("moelora-conformance", *(a.format(fixtures=fixtures) for a in MAIN_CHECKS["hf-check"]),
                    env=CPU_ENV)
    return fixtures


def _suite(session: nox.Session, run_args: list[str]) -> None:
    """The conformance suite on the built-in backends (two xdist workers) and its support matrix."""
    session.run(
        "moelora-conformance", "run", "--backend", "reference", "--backend", "triton", "--backend", "csgmv",
        "-n", "2", "--json", str(REPORTS / "conformance.json"), "--junitxml", str(REPORTS / "conformance.xml"),
        "--markdown", str(REPORTS / "support-matrix.md"), *run_args, env=CPU_ENV,
    )


def _checks(session: nox.Session, checks: dict[str, list[str]], workers: int = 2) -> None:
    """Run ``moelora-conformance <args>`` for every check, ``workers`` at a time (each a single-threaded
    process: two cores, two checks), each into its own log; print each log's tail as it ends (the whole log
    of a failure) and fail the session if any failed."""
    import subprocess
    import time

    logs = REPORTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **CPU_ENV, "PATH": f"{session.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    pending, running, failed = list(checks.items()), {}, []
    while pending or running:
        while pending and len(running) < workers:
            name, args = pending.pop(0)
            log = (logs / f"{name}.log").open("w")
            session.log(f"{name}: moelora-conformance {' '.join(args)}")
            proc = subprocess.Popen([str(Path(session.bin) / "moelora-conformance"), *args], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
            running[name] = (proc, log, time.perf_counter())
        time.sleep(0.5)
        for name, (proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            text = (logs / f"{name}.log").read_text()
            shown = text if proc.returncode else "\n".join(text.splitlines()[-25:])
            print(shown, flush=True)
            session.log(f"{name}: exit {proc.returncode} after {time.perf_counter() - start:.0f} s "
                        f"(log: {logs / f'{name}.log'})")
            if proc.returncode:
                failed.append(name)
    if failed:
        session.error(f"failed: {', '.join(failed)}")


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
    layer suite (interpret profile, 1 example per item, a fixed Hypothesis seed, no shrinking) and the
    e2e suite on the engine (CI-sized, every engine mode) with its expected-failure manifests
    (packages/peers/manifests, each entry citing conformance/docs/peers.md). The peers are installed
    with ``--no-deps`` (their metadata pins a torch that ci/constraints/cpu.txt forbids); their small
    dependencies come from ci/constraints/peers.txt. Writes .reports/peers.json (one record per cell) and
    .reports/peers-matrix.md; red on an unexpected failure, a stale manifest entry or a refused path.

    Extra arguments go to ``python -m moelora_peers.grid run`` (``nox -s peers -- --path sglang:legacy``;
    ``-- --path sglang:legacy --smoke``: the CI's one path, layer suite in one dtype, no fixtures).
    """
    peers_constraints = ROOT / "ci" / "constraints" / "peers.txt"
    _install_moelora(session)
    session.install("-c", str(CONSTRAINTS), "-c", str(peers_constraints), "--no-deps", "sglang", "vllm")
    session.install("-c", str(CONSTRAINTS), "-c", str(peers_constraints), "msgspec", "pydantic")
    session.install("-c", str(CONSTRAINTS), "--no-deps", "--no-build-isolation", "-e", "./packages/peers[test]")
    REPORTS.mkdir(exist_ok=True)
    # --smoke (CI's budget): the import and release checks only; the protocol and benchmark tests run
    # every path's kernels under the interpreter
    tests = ["packages/peers/tests/test_peer_imports.py"] if "--smoke" in session.posargs else ["packages/peers/tests"]
    session.run("python", "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", env=CPU_ENV)
    grid = ["python", "-m", "moelora_peers.grid", "run", "--out", str(REPORTS)]
    if "--smoke" not in session.posargs and "--fixtures" not in session.posargs:
        fixtures = ROOT / "fixtures-cache"  # the e2e suite's models and adapters (reused when built)
        session.run("moelora-conformance", "make-fixtures", str(fixtures), env=CPU_ENV)
        grid += ["--fixtures", str(fixtures)]
    session.run(*grid, *session.posargs, env=CPU_ENV)
