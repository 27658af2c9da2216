"""``moelora-conformance e2e``: the e2e suite on backends and checkpoints, with the layer suite's
report and support matrix.

    moelora-conformance e2e [--backend X ...] [--model DIR --adapter NAME=DIR ...] [--fixtures DIR]
        [--families F,...] [--modes eager,decode_graph,full,breakable] [--properties E01,...]
        [--manifest [X=]M] [--json out.json] [--markdown matrix.md] [--requests 64] [--max-new-tokens 8]
        [--state-machine-examples 20] [--require-coverage] [engine capacity options]

Without ``--model`` it runs the CI-sized default on fixtures built locally (:mod:`.suite`): every
fixture family with ``reference``, one per other backend, each with the engine adapters
(:mod:`.adapters`). Exit status: 0 every claim held (expected failures allowed; ``partial`` and ``not
meaningful`` claims are listed as not proven), 1 a failure or a stale manifest entry (or, with
``--require-coverage``, a claim not proven), 2 a usage error (bad arguments, a directory that is not a
checkpoint, an adapter the reader refuses, an unknown backend, a bad manifest), 5 nothing ran, 130 Ctrl-C:
one line says what each ``--json`` report holds (the backend cut short: its finished claims, ``"complete":
false``), no traceback.

Every record's rerun line (``run.rerun_line``) is a command that reproduces its run: the same inputs
(absolute ``--model`` / ``--adapter`` paths; for the fixtures, ``--families F`` and ``--fixtures DIR``
when one was given — built fixtures are the same bytes every build, so a rerun rebuilds them rather
than pointing into this run's deleted temporary directory), every option that shaped it, and its
mode's workload claims or the state machine. No-op adapters are named on stderr at load.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

from moelora_conformance.commands import (
    Handler,
    fixtures_or_exit,
    per_backend,
    per_backend_path,
    require_fixtures_extra,
    subcommand,
)

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
    parser.add_argument("--properties", default=None,
                        help="comma-separated claims to check (default all, E01-E06; E06 alone serves no workload)")
    parser.add_argument("--require-coverage", action="store_true",
                        help="a claim not proven (partial, not meaningful) fails the run (exit 1); the main job's")
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
    parser.add_argument("--arrival-steps", type=int, default=None,
                        help="arrivals spread over this many steps (default: twice the requests)")
    defaults = _config_defaults()
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help=f"the step's token budget (default {defaults.max_num_batched_tokens})")
    parser.add_argument("--prefill-token-buckets", default=_csv(defaults.prefill_token_buckets),
                        help=f"captured prefill buckets, tokens (default {_csv(defaults.prefill_token_buckets)})")
    parser.add_argument("--max-num-requests", type=int, default=defaults.max_num_requests,
                        help=f"request slots of the prefill graph (default {defaults.max_num_requests})")
    parser.add_argument("--decode-batch-buckets", default=_csv(defaults.decode_batch_buckets),
                        help=f"captured decode buckets, requests (default {_csv(defaults.decode_batch_buckets)})")
    parser.add_argument("--kv-cache-tokens", type=int, default=defaults.kv_cache_tokens,
                        help=f"KV cache locations (default {defaults.kv_cache_tokens})")
    parser.add_argument("--state-machine-examples", type=int, default=20,
                        help="examples of the stateful engine properties (E06; 0 skips them; default 20)")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 (default float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF + PEFT comparison (E02 not run)")
    parser.add_argument("--record-jsonl", type=Path, default=None,
                        help="append every graph-vs-eager measurement here (tolerance rows)")

    def run(args: argparse.Namespace) -> int:
        written: dict[Path, dict] = {}  # each JSON report this run wrote → the last report written there
        try:
            return _checked_run(args, written)
        except KeyboardInterrupt:  # GenerateInterrupted included: one line, exit 130, no traceback
            return _interrupted(args, written)

    return run


def _checked_run(args: argparse.Namespace, written: dict[Path, dict]) -> int:
    import importlib.util

    from moelora_core.errors import InvalidFieldError

    if importlib.util.find_spec("moelora_runner") is None:
        return _usage("needs the engine (moelora-runner): pip install ./packages/runner or "
                      "'moelora-conformance[e2e]'")

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in _modes()]
    if bad or not modes:
        return _usage(f"--modes: unknown {bad}; known {list(_modes())}")
    from moelora_conformance.e2e.properties import E2E_PROPERTIES

    properties = [p.strip() for p in (args.properties or ",".join(E2E_PROPERTIES)).split(",") if p.strip()]
    unknown = [p for p in properties if p not in E2E_PROPERTIES]
    if unknown or not properties:
        return _usage(f"--properties: unknown {unknown}; known {list(E2E_PROPERTIES)}")
    try:
        buckets = {name: tuple(int(v) for v in getattr(args, name).split(",") if v.strip())
                   for name in ("prefill_token_buckets", "decode_batch_buckets")}
    except ValueError as exc:
        return _usage(f"bucket lists are comma-separated integers: {exc}")
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

            manifests[backend] = load_e2e_manifest(per_backend(args.manifest, backend))
        except InvalidFieldError as exc:
            return _usage(str(exc))
    from moelora_conformance.e2e.run import E2EConfig

    config = E2EConfig(requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed,
                       max_prompt_tokens=args.max_prompt_tokens, max_loras=args.max_loras,
                       state_machine_examples=args.state_machine_examples, modes=tuple(modes),
                       properties=tuple(properties), arrival_steps=args.arrival_steps,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_requests=args.max_num_requests,
                       kv_cache_tokens=args.kv_cache_tokens, **buckets)
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
            plan = {b: [(args.model.name, args.model, adapters)] for b in backends}  # inputs: run.model_inputs
        else:
            plan = _fixture_plan(args, backends, Path(tmp))
            if isinstance(plan, int):
                return plan
        return _run(plan, args, config, manifests, per_backend_path, written)


def _modes() -> tuple[str, ...]:
    from moelora_conformance.e2e.results import E2E_MODES

    return E2E_MODES


def _config_defaults():
    from moelora_conformance.e2e.run import E2EConfig

    return E2EConfig()


def _csv(values) -> str:
    return ",".join(map(str, values))


def _rerun_extra(args, backend: str) -> list[str]:
    """The options every rerun line of ``backend`` ends with: its manifest (absolute), ``--no-hf``,
    ``--require-coverage``."""

    out = []
    manifest = per_backend(args.manifest, backend)
    if manifest:
        out += ["--manifest", str(Path(manifest).resolve())]
    if args.no_hf:
        out.append("--no-hf")
    if args.require_coverage:
        out.append("--require-coverage")
    return out


def _load(backend: str):
    from moelora_core import load_backend

    return load_backend(backend)


def _fixture_plan(args, backends: list[str], tmp: Path):
    """backend → [(family, model dir, {adapter: dir})] on the fixtures (built here unless given)."""
    if not require_fixtures_extra("e2e"):
        return 2
    from moelora_conformance.e2e.adapters import (
        build_engine_adapters,
        engine_adapter_dirs,
        model_names,
        opt_in_model_names,
    )
    from moelora_conformance.e2e.suite import default_models
    from moelora_conformance.fixtures import build_fixtures
    from moelora_conformance.fixtures.specs import OPT_IN_FP8_MODELS

    chosen = {b: ([f.strip() for f in args.families.split(",") if f.strip()] if args.families else default_models(b))
              for b in backends}
    known = model_names() + opt_in_model_names()
    unknown = sorted({f for fams in chosen.values() for f in fams} - set(known))
    if unknown:
        return _usage(f"--families: unknown {unknown}; known {known}")
    needed = sorted({f for fams in chosen.values() for f in fams})
    # opt-in fixture models (OPT_IN_FP8_MODELS) are built only where a run names them
    built_on_request = [f for f in needed if f in {m.name for m in OPT_IN_FP8_MODELS}]
    fixtures = fixtures_or_exit(args.fixtures, "e2e") if args.fixtures else \
        build_fixtures(tmp / "fixtures", families=built_on_request)
    if fixtures is None:
        return 2
    if missing := [f for f in needed if f not in fixtures.manifest["models"]]:
        return _usage(f"--families: {missing} not in {args.fixtures}: build them with "
                      f"moelora-conformance make-fixtures {args.fixtures} --families {','.join(missing)}")
    root = tmp / "engine-adapters"
    build_engine_adapters(root, needed)
    dirs = engine_adapter_dirs(root, needed)
    # a rerun names the family (and the user's fixtures directory): the fixtures and engine adapters are
    # rebuilt byte-identically, where this run's temporary directory is gone once it exits
    given = ["--fixtures", str(args.fixtures.resolve())] if args.fixtures else []
    return {b: [(f, fixtures.model_dir(f), dict(dirs[f]), [*given, "--families", f]) for f in fams]
            for b, fams in chosen.items()}


def _write_json(path: Path, report: dict) -> None:
    """Write ``report`` whole or not at all (a run killed mid-write keeps the previous report)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def _write_and_note(path: Path, written: dict[Path, dict], report: dict) -> None:
    _write_json(path, report)
    written[path] = report


def _interrupted(args: argparse.Namespace, written: dict[Path, dict]) -> int:
    """Ctrl-C: one line on stderr saying what the JSON reports hold, exit 130 (128 + SIGINT, as ``moelora
    generate``), no traceback. A report at a path this run was to write but did not (an earlier run's) is
    removed: it must not look like this run's."""

    backends = list(dict.fromkeys(args.backend or _BUILTINS))  # the plan's keys (_run: one report per backend)
    paths = [p for b in backends if (p := per_backend_path(args.json, b, len(backends) > 1)) is not None]
    stale = [p for p in paths if p not in written and p.exists()]
    for path in stale:
        path.unlink()
    parts = [f"{p} holds the finished claims (complete: false)" for p, r in written.items() if not r["complete"]]
    parts += [f"{p} is complete" for p, r in written.items() if r["complete"]]
    if not written:
        parts.append("no claim had finished" if args.json else "no --json given, so no report was written")
    if stale:
        parts.append(f"an earlier run's {', '.join(map(str, stale))} removed")
    print(f"{_PREFIX}: interrupted (Ctrl-C); {'; '.join(parts)}", file=sys.stderr, flush=True)
    return 130


def _run(plan: dict, args, config, manifests: dict, json_path, written: dict[Path, dict]) -> int:
    from moelora_conformance.e2e.suite import run_e2e
    from moelora_conformance.report import exit_status, matrix_markdown, matrix_rich, summary_line

    def progress(r):
        print(f"{_PREFIX}: {r.test} {r.outcome} ({r.duration:.1f} s){': ' + r.message if r.message else ''}",
              flush=True)

    def warn(message: str) -> None:
        print(f"{_PREFIX}: warning: {message}", file=sys.stderr, flush=True)

    reports, many = [], len(plan) > 1
    for backend, models in plan.items():
        print(f"{_PREFIX}: {backend} on {', '.join(m[0] for m in models)} ({args.dtype}, {args.device})", flush=True)
        out = json_path(args.json, backend, many)
        write = None if out is None else functools.partial(_write_and_note, out, written)
        report = run_e2e(backend, models, config=config, dtype=args.dtype, device=args.device,
                         manifest=manifests[backend], hf=not args.no_hf, record_path=args.record_jsonl,
                         progress=progress, rerun_extra=_rerun_extra(args, backend), warn=warn,
                         write=write)
        reports.append(report)
    matrix_rich(reports)
    if args.markdown:
        args.markdown.write_text(matrix_markdown(reports))
    status = exit_status(reports, require_coverage=args.require_coverage)
    for rep in reports:
        print(f"{_PREFIX}: {rep['backend']['target']}: {summary_line(rep)}", flush=True)
    if status == 5:
        print(f"{_PREFIX}: nothing ran (every claim not run or not implemented)", file=sys.stderr)
    elif status == 1 and not any(r["outcome"] in ("failed", "xpassed") for rep in reports for r in rep["records"]):
        print(f"{_PREFIX}: --require-coverage: claims not proven (partial, not meaningful) fail this run",
              file=sys.stderr)
    return status
