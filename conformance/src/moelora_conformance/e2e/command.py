"""``moelora-conformance e2e``: the e2e suite on backends and checkpoints, with the layer suite's
report and support matrix.

    moelora-conformance e2e [--backend X ...] [--model DIR --adapter NAME=DIR ...] [--fixtures DIR]
        [--modes eager,decode_graph,full,breakable] [--manifest [X=]M] [--json out.json]
        [--markdown matrix.md] [--requests 64] [--max-new-tokens 8] [--state-machine-examples 20]

Without ``--model`` it runs the CI-sized default on fixtures built locally (:mod:`.suite`): every
fixture family with ``reference``, one per other backend, each with the engine adapters
(:mod:`.adapters`). Exit status: 0 every claim held (expected failures allowed), 1 a failure or a
stale manifest entry, 2 a usage error (bad arguments, a directory that is not a checkpoint, an
adapter the reader refuses, an unknown backend, a bad manifest), 5 nothing ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from moelora_conformance.commands import Handler, fixtures_or_exit, require_fixtures_extra, subcommand

_BUILTINS = ["reference", "triton", "csgmv"]
_PREFIX = "moelora-conformance e2e"


def _usage(message: str) -> int:
    print(f"{_PREFIX}: {message}", file=sys.stderr)
    return 2


def _adapters(values: list[str]) -> dict[str, Path] | str:
    out: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            return f"--adapter {value!r}: expected NAME=DIR"
        if name in out:
            return f"--adapter {name!r} given twice"
        if not (Path(path) / "adapter_config.json").is_file():
            return f"--adapter {name}={path}: not a PEFT adapter directory (no adapter_config.json)"
        out[name] = Path(path)
    return out


def _check_model(model: Path, adapters: dict[str, Path]) -> str | None:
    """Why ``model`` + ``adapters`` cannot run (None: they can): the reader's refusal, named."""
    from moelora_conformance.e2e.run import adapter_kinds
    from moelora_core.errors import MoeLoraError
    from moelora_runner.model_info import ModelInfo

    if not (model / "config.json").is_file():
        return f"--model {model}: not a Hugging Face checkpoint directory (no config.json)"
    try:
        adapter_kinds(adapters, ModelInfo.read(model).config)
    except MoeLoraError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@subcommand("e2e", help="the e2e suite on the engine: backend x engine mode over a ragged mixed workload, graph vs "
                        "eager, vs HF+PEFT, the metrics, the stateful engine properties")
def _e2e(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("--backend", action="append", default=None,
                        help="module:factory or a built-in name (repeatable; default reference, triton, csgmv)")
    parser.add_argument("--model", type=Path, default=None, help="your HF MoE checkpoint (with --adapter)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                        help="a PEFT adapter for --model (repeatable; at least two, so slots are evicted)")
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="fixtures built by make-fixtures (default: build into a temporary directory)")
    parser.add_argument("--families", default=None,
                        help="comma-separated fixture families for every backend (default: all with reference, "
                             "one per other backend)")
    parser.add_argument("--modes", default=",".join(_modes()), help="comma-separated engine modes (default: all)")
    parser.add_argument("--manifest", action="append", default=None,
                        help="expected failures: PATH for every backend, or BACKEND=PATH (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="JSON report (several backends: NAME-BACKEND.json)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the support matrix as Markdown")
    parser.add_argument("--requests", type=int, default=64, help="requests of the workload (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="longest generation (default 8)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt (default: the model's context minus --max-new-tokens)")
    parser.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: adapters - 1)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    parser.add_argument("--state-machine-examples", type=int, default=20,
                        help="examples of the stateful engine properties (E06; 0 skips them; default 20)")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 (default float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF + PEFT comparison (E02 not run)")
    parser.add_argument("--record-jsonl", type=Path, default=None,
                        help="append every graph-vs-eager measurement here (tolerance rows)")

    def run(args: argparse.Namespace) -> int:
        import importlib.util

        from moelora_conformance.cli import _json_path, _per_backend
        from moelora_core.errors import InvalidFieldError

        if importlib.util.find_spec("moelora_runner") is None:
            return _usage("needs the engine (moelora-runner): pip install ./packages/runner or "
                          "'moelora-conformance[e2e]'")

        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in _modes()]
        if bad or not modes:
            return _usage(f"--modes: unknown {bad}; known {list(_modes())}")
        if args.adapter and args.model is None:
            return _usage("--adapter needs --model (the checkpoint the adapters were made for)")
        if args.requests < 2 or args.max_new_tokens < 1:
            return _usage("--requests must be >= 2 and --max-new-tokens >= 1")
        backends = args.backend or _BUILTINS
        for backend in backends:
            try:
                _load(backend)
            except InvalidFieldError as exc:
                return _usage(f"--backend {backend}: {exc}")
        manifests = {}
        for backend in backends:
            try:
                from moelora_conformance.e2e.suite import load_e2e_manifest

                manifests[backend] = load_e2e_manifest(_per_backend(args.manifest, backend))
            except InvalidFieldError as exc:
                return _usage(str(exc))
        from moelora_conformance.e2e.run import E2EConfig

        config = E2EConfig(requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed,
                           max_prompt_tokens=args.max_prompt_tokens, max_loras=args.max_loras,
                           state_machine_examples=args.state_machine_examples,
                           require_adapter_kinds=args.model is None, modes=tuple(modes))
        with tempfile.TemporaryDirectory(prefix="moelora-e2e-") as tmp:
            if args.model is not None:
                adapters = _adapters(args.adapter)
                if isinstance(adapters, str):
                    return _usage(adapters)
                if len(adapters) < 2:
                    return _usage("give at least two --adapter NAME=DIR (one slot fewer than adapters: slots are "
                                  "evicted and reused)")
                why = _check_model(args.model, adapters)
                if why:
                    return _usage(why)
                plan = {b: [(args.model.name, args.model, adapters)] for b in backends}
            else:
                plan = _fixture_plan(args, backends, Path(tmp))
                if isinstance(plan, int):
                    return plan
            return _run(plan, args, config, manifests, _json_path)

    return run


def _modes() -> tuple[str, ...]:
    from moelora_conformance.e2e.results import E2E_MODES

    return E2E_MODES


def _load(backend: str):
    from moelora_core import load_backend

    return load_backend(backend)


def _fixture_plan(args, backends: list[str], tmp: Path):
    """backend → [(family, model dir, {adapter: dir})] on the fixtures (built here unless given)."""
    if not require_fixtures_extra("e2e"):
        return 2
    from moelora_conformance.e2e.adapters import build_engine_adapters, engine_adapter_dirs, model_names
    from moelora_conformance.e2e.suite import default_models
    from moelora_conformance.fixtures import build_fixtures

    fixtures = fixtures_or_exit(args.fixtures, "e2e") if args.fixtures else build_fixtures(tmp / "fixtures")
    if fixtures is None:
        return 2
    chosen = {b: ([f.strip() for f in args.families.split(",") if f.strip()] if args.families else default_models(b))
              for b in backends}
    unknown = sorted({f for fams in chosen.values() for f in fams} - set(model_names()))
    if unknown:
        return _usage(f"--families: unknown {unknown}; known {model_names()}")
    needed = sorted({f for fams in chosen.values() for f in fams})
    root = tmp / "engine-adapters"
    build_engine_adapters(root, needed)
    dirs = engine_adapter_dirs(root, needed)
    return {b: [(f, fixtures.model_dir(f), dict(dirs[f])) for f in fams] for b, fams in chosen.items()}


def _run(plan: dict, args, config, manifests: dict, json_path) -> int:
    from moelora_conformance.e2e.suite import run_e2e
    from moelora_conformance.report import EXECUTED, matrix_markdown, matrix_rich, unexpected_failures

    def progress(r):
        print(f"{_PREFIX}: {r.test} {r.outcome} ({r.duration:.1f} s){': ' + r.message if r.message else ''}",
              flush=True)

    reports, many = [], len(plan) > 1
    for backend, models in plan.items():
        print(f"{_PREFIX}: {backend} on {', '.join(m for m, _, _ in models)} ({args.dtype}, {args.device})",
              flush=True)
        report = run_e2e(backend, models, config=config, dtype=args.dtype, device=args.device,
                         manifest=manifests[backend], hf=not args.no_hf, record_path=args.record_jsonl,
                         progress=progress)
        reports.append(report)
        out = json_path(args.json, backend, many)
        if out is not None:
            out.write_text(json.dumps(report, indent=1, default=str))
    matrix_rich(reports)
    if args.markdown:
        args.markdown.write_text(matrix_markdown(reports))
    if any(unexpected_failures(rep) for rep in reports):
        return 1
    if not any(r["outcome"] in EXECUTED for rep in reports for r in rep["records"]):
        print(f"{_PREFIX}: nothing ran (every claim not run or not implemented)", file=sys.stderr)
        return 5
    return 0
