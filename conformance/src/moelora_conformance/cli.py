"""``moelora-conformance``: the conformance command line, one subcommand per job.

Subcommands register themselves in :data:`SUBCOMMANDS` with :func:`subcommand`; each adds its own
arguments and returns an exit status. Built in here:

- ``make-fixtures DIR``: build the local HF MoE models and PEFT adapters (extra ``fixtures``).
- ``hf-check [--fixtures DIR] [--only-adapter NAME ...]`` or ``hf-check --model DIR --adapter NAME=DIR
  ...``: the oracle against HF transformers + PEFT on every fixture (built into a temporary directory
  unless given), or on your own checkpoint and adapters (expected ranks and σ read from the files);
  prints the table and exits 1 on any failure, 2 on a usage error (a directory that is not a
  checkpoint or an adapter: what is missing is named); a no-op adapter is named at load and its pair is
  "not meaningful" (exit 0; 1 with ``--require-coverage``).

Both exit 2 when the ``fixtures`` extra (transformers + peft) is not installed.

The conformance suite's own subcommands:

- ``run --backend X [--backend Y ...] --profile P [--manifest [X=]M] [--max-examples [X=]N]
  [--dtypes [X=]fp32,fp16] [--skip-modes [X=]prefill-breakable] [--json out.json] [--require-coverage]``:
  run the suite on each backend in a subprocess and print the support matrix with rich; exit 1 on any
  unexpected failure (what ``nox -s conformance`` calls).
- ``report results.json [...] [--output matrix.md] [--require-coverage]``: render the support matrix of
  JSON reports as Markdown; exit as the runs did (1 an unexpected failure or a stale manifest entry —
  or, with ``--require-coverage``, a claim not proven —, 5 nothing ran, else 0).
- ``mutations [--write-docs [PATH]] [--only NAME]``: run the suite against every mutant of the
  reference backend (``moelora_conformance.faulty``) and print (or write) the table mutation →
  catching property → seconds; ``--write-docs`` also runs each without the metadata-only properties;
  exit 1 if one is not caught; ``--engine`` runs the engine-level mutants against the stateful engine
  properties (E06) and the backend faults only an engine shows against the e2e workload instead.
- ``checkpoint-pass [--fixtures DIR] [--backends reference,triton,csgmv]``: every backend × layer mode
  on the real checkpoints and PEFT adapters, against the oracle and HF + PEFT per adapter; prints
  the table, exits 1 on any failed comparison (:mod:`moelora_conformance.checkpoint_pass.command`).
- ``e2e [--backend X ...] [--model DIR --adapter NAME=DIR ...] [--modes ...] [--manifest M] [--json J]
  [--markdown MD]``: the e2e suite on the engine; exit 0 / 1 / 2 / 5 (:mod:`moelora_conformance.e2e.command`).

Subcommands register in :mod:`moelora_conformance.commands` (modules holding subcommands import it,
not this one). A subcommand registers itself like this::

    @subcommand("report", help="render the support matrix")
    def add_report(parser): ...          # declare arguments; return the handler
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from moelora_conformance import commands
from moelora_conformance.commands import (  # noqa: F401 (re-exported: the registry's old home)
    SUBCOMMANDS,
    Handler,
    Subcommand,
    fixtures_or_exit,
    per_backend,
    per_backend_path,
    require_fixtures_extra,
    subcommand,
    user_files_or_exit,
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    """The top-level parser and the handler of each subcommand."""
    parser = argparse.ArgumentParser(prog="moelora-conformance",
                                     description="moelora's conformance suite for MoE multi-LoRA backends")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    handlers = {}
    for sub in commands.SUBCOMMANDS.values():
        handlers[sub.name] = sub.configure(subs.add_parser(sub.name, help=sub.help, description=sub.help))
    return parser, handlers


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moelora-conformance`` (and ``python -m moelora_conformance``).

    Ctrl-C anywhere a subcommand does not handle it itself (building the parser imports torch for some
    defaults) prints one line and returns 130 (128 + SIGINT), no traceback; ``e2e`` says what its
    reports hold (:mod:`moelora_conformance.e2e.command`)."""
    try:
        parser, handlers = build_parser()
        args = parser.parse_args(argv)
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("moelora-conformance: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


# --- built-in subcommands -----------------------------------------------------------------------


@subcommand("make-fixtures", help="build the local HF MoE models and PEFT adapters (needs the 'fixtures' extra)")
def _make_fixtures(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("directory", type=Path, help="output directory (models/, adapters/, bad_adapters/, "
                        "manifest.json)")
    parser.add_argument("--families", default="", metavar="F,...",
                        help="also build these opt-in fixture models (e.g. qwen2_moe_fp8)")

    def run(args: argparse.Namespace) -> int:
        if not require_fixtures_extra("make-fixtures"):
            return 2
        from moelora_conformance.fixtures import build_fixtures
        from moelora_core.errors import InvalidFieldError

        families = [f.strip() for f in args.families.split(",") if f.strip()]
        try:  # build_fixtures checks the names before it writes anything
            fixtures = build_fixtures(args.directory, families=families)
        except InvalidFieldError as exc:
            print(f"moelora-conformance make-fixtures: --{exc}", file=sys.stderr)
            return 2
        m = fixtures.manifest
        print(f"built {len(m['models'])} models, {len(m['adapters'])} adapters, {len(m['layout_adapters'])} "
              f"shared-outer / fully shared adapters, {len(m['bad_adapters'])} bad adapters in {args.directory} "
              f"(manifest.json)")
        return 0

    return run


@subcommand("hf-check", help="check the oracle and the checkpoint readers against HF transformers + PEFT")
def _hf_check(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="a directory built by make-fixtures (default: build into a temporary directory)")
    parser.add_argument("--model", type=Path, default=None,
                        help="your own Hugging Face MoE checkpoint directory (instead of the fixtures)")
    parser.add_argument("--adapter", action="append", default=None, metavar="NAME=DIR",
                        help="with --model: one of your PEFT adapters, checked on it (repeatable)")
    parser.add_argument("--only-adapter", action="append", default=None, metavar="NAME",
                        help="check only this fixture adapter (repeatable)")
    parser.add_argument("--require-coverage", action="store_true",
                        help="a pair not proven (a no-op adapter: not meaningful) fails the run (exit 1)")

    def run(args: argparse.Namespace) -> int:
        if not require_fixtures_extra("hf-check"):
            return 2
        from moelora_conformance.fixtures import build_fixtures
        from moelora_conformance.hf_check import render, run_hf_check

        given = user_files_or_exit(args, "hf-check")
        if given is False:
            return 2
        with tempfile.TemporaryDirectory(prefix="moelora-fixtures-") as tmp:
            if given is not None:
                fixtures, only = given, None
            else:
                fixtures = fixtures_or_exit(args.fixtures, "hf-check") if args.fixtures else build_fixtures(Path(tmp))
                if fixtures is None:
                    return 2
                only = args.only_adapter
                known = set(fixtures.manifest["adapters"]) | set(fixtures.layout_adapters())
                unknown = sorted(set(only or []) - known)
                if unknown:
                    print(f"moelora-conformance hf-check: unknown --only-adapter {unknown}; fixture adapters: "
                          f"{sorted(known)}", file=sys.stderr)
                    return 2
            rows = run_hf_check(fixtures, adapters=only)
        from moelora_conformance.user_files import noop_adapters

        return 0 if render(rows, noop=noop_adapters(fixtures), require_coverage=args.require_coverage) else 1

    return run


def _int_or_none(value: str | None) -> int | None:
    return None if value is None else int(value)


def _selection(dtypes: str | None, skip_modes: str | None = None) -> list[str] | str:
    """pytest's ``-k`` for a ``--dtypes`` list and a ``--skip-modes`` list (items are named
    ``test_...[<mode>-<dtype>]``), [] for every item, or why a list is not one.

    A skipped mode is matched with its opening bracket (``[eager-``), so a test whose name holds a mode's
    word (``..._equals_eager``) is not taken for one of that mode's items. The prefill-family items of
    P06 / P07 / P12 (``[prefill-<dtype>]``) belong to neither prefill graph mode and stay.
    """
    from moelora_conformance.strategies.shapes import DTYPE_NAMES
    from moelora_conformance.strategies.suite import LAYER_MODES

    terms = []
    if dtypes is not None:
        known = sorted(DTYPE_NAMES.values())
        chosen = [d.strip() for d in dtypes.split(",") if d.strip()]
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            return f"--dtypes: unknown {unknown or dtypes!r}; known {known}"
        terms.append(f"({' or '.join(chosen)})")
    if skip_modes is not None:
        skipped = [m.strip() for m in skip_modes.split(",") if m.strip()]
        unknown = sorted(set(skipped) - set(LAYER_MODES))
        if unknown or not skipped or set(skipped) == set(LAYER_MODES):
            return f"--skip-modes: unknown {unknown or skip_modes!r} or every mode; known {list(LAYER_MODES)}"
        terms += [f"not [{m}-" for m in skipped]
    return ["-k", " and ".join(terms)] if terms else []


@subcommand("run", help="run the conformance suite on backends and print the support matrix")
def _run(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("--backend", action="append", required=True,
                        help="module:factory or a built-in name (repeatable)")
    parser.add_argument("--profile", default=None, help="moelora profile (default $MOELORA_PROFILE or dev)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--manifest", action="append", default=None,
                        help="expected failures: PATH for every backend, or BACKEND=PATH (repeatable)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the JSON report here (several backends: NAME-BACKEND.json)")
    parser.add_argument("--junitxml", type=Path, default=None, help="write JUnit XML here (per backend likewise)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the matrix as Markdown")
    parser.add_argument("--max-examples", action="append", default=None,
                        help="examples per property item: N for every backend, or BACKEND=N (repeatable)")
    parser.add_argument("--dtypes", action="append", default=None, metavar="[BACKEND=]fp32,fp16",
                        help="only these dtypes' items: a list for every backend, or BACKEND=LIST (repeatable; "
                             "default every dtype the backend declares)")
    parser.add_argument("--skip-modes", action="append", default=None, metavar="[BACKEND=]prefill-breakable",
                        help="leave these layer modes' items out: a list for every backend, or BACKEND=LIST "
                             "(repeatable; default none)")
    parser.add_argument("-n", "--workers", type=int, default=None, help="pytest-xdist workers per run")
    parser.add_argument("--require-coverage", action="store_true",
                        help="a claim not proven (partial, not meaningful) fails the run (exit 1), as in e2e")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")

    def run(args: argparse.Namespace) -> int:
        import os

        from moelora_conformance.report import exit_status, matrix_markdown, matrix_rich, unexpected_failures
        from moelora_conformance.session import run_suite

        profile = args.profile or os.environ.get("MOELORA_PROFILE", "dev")
        many = len(args.backend) > 1
        selections = {}
        for backend in args.backend:
            selection = _selection(per_backend(args.dtypes, backend), per_backend(args.skip_modes, backend))
            if isinstance(selection, str):
                print(f"moelora-conformance run: {selection}", file=sys.stderr)
                return 2
            selections[backend] = selection
        reports, status = [], 0
        for backend in args.backend:
            junit = per_backend_path(args.junitxml, backend, many)
            print(f"moelora-conformance run: {backend} (profile {profile}, {args.device})", flush=True)
            result = run_suite(backend, profile=profile, device=args.device, cwd=Path.cwd(),
                               report_json=per_backend_path(args.json, backend, many),
                               manifest=per_backend(args.manifest, backend), junitxml=junit,
                               max_examples=_int_or_none(per_backend(args.max_examples, backend)),
                               workers=args.workers, extra=[*selections[backend], *args.pytest_args])
            if result.report is None:
                print(result.output, file=sys.stderr)
                print(f"moelora-conformance run: {backend}: pytest exited {result.returncode} without a report",
                      file=sys.stderr)
                status = 1
                continue
            reports.append(result.report)
            if result.returncode != 0 or unexpected_failures(result.report):
                print(result.output[-6000:], file=sys.stderr)
                status = 1
        if reports:
            matrix_rich(reports)
            if args.markdown:
                args.markdown.write_text(matrix_markdown(reports))
            if args.require_coverage and exit_status(reports, require_coverage=True) == 1:
                status = 1
        return status

    return run


@subcommand("report", help="render the support matrix (Markdown) of conformance JSON reports; exit as the runs did")
def _report(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("reports", nargs="+", type=Path, help="JSON reports written by --report-json")
    parser.add_argument("--output", type=Path, default=None, help="write here instead of stdout")
    parser.add_argument("--require-coverage", action="store_true",
                        help="exit 1 when a claim is not proven (partial, not meaningful), as the run with it did")

    def run(args: argparse.Namespace) -> int:
        from moelora_conformance.report import exit_status, load_report, matrix_markdown

        try:
            reports = [load_report(p) for p in args.reports]
        except (OSError, ValueError) as exc:
            print(f"moelora-conformance report: {exc}", file=sys.stderr)
            return 2
        text = matrix_markdown(reports)
        if args.output:
            args.output.write_text(text)
        else:
            print(text, end="")
        # as the runs exited: 1 for an unexpected failure or a stale manifest entry, 0 when every failure is
        # in the manifest, 5 when nothing ran (report.exit_status)
        return exit_status(reports, require_coverage=args.require_coverage)

    return run


@subcommand("mutations", help="run the suite against every reference mutant; print the catching properties")
def _mutations(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("--write-docs", nargs="?", type=Path, const=True, default=None,
                        help="write the table to conformance/docs/mutations.md (or PATH)")
    parser.add_argument("--only", action="append", default=None, help="run only this mutation (repeatable)")
    parser.add_argument("--profile", default="interpret", help="moelora profile (default interpret)")
    parser.add_argument("--seed", type=int, default=0, help="--hypothesis-seed of every run (default 0)")
    parser.add_argument("--engine", action="store_true",
                        help="run the engine-level mutants against the E06 state machine and the backend faults "
                             "only an engine shows against the e2e workload (needs moelora_runner)")
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="--engine: a directory built by make-fixtures (default: build into a temporary directory)")

    def run(args: argparse.Namespace) -> int:
        if args.engine:
            return _engine_mutations(args)
        from moelora_conformance.faulty import CAP_MUTANTS, MUTANTS
        from moelora_conformance.faulty.campaign import DOCS, run_campaign, table_markdown, write_docs

        known = {*MUTANTS, *CAP_MUTANTS}
        unknown = set(args.only or []) - known
        if unknown:
            print(f"moelora-conformance mutations: unknown {sorted(unknown)}; known {sorted(known)}", file=sys.stderr)
            return 2

        def progress(r):
            where = f"{r.property} {r.test}" if r.caught else "NOT CAUGHT"
            print(f"{r.name:28s} {where}  {r.seconds:.1f} s", flush=True)

        results = run_campaign(args.only, profile=args.profile, seed=args.seed, progress=progress)
        others = None
        if args.write_docs is not None:
            print("again without the metadata-only properties (P06, P07):", flush=True)
            others = run_campaign(args.only, profile=args.profile, seed=args.seed, without_metadata=True,
                                  progress=progress)
        text = table_markdown(results, profile=args.profile, seed=args.seed, without_metadata=others)
        if args.write_docs is not None:
            path = DOCS if args.write_docs is True else args.write_docs
            write_docs(path, text)
            print(f"wrote {path}")
        return 0 if all(r.caught for r in results) else 1  # the full suite must catch every one

    return run


def _engine_mutations(args: argparse.Namespace) -> int:
    """``mutations --engine``: every engine mutant against the state machine and its named history, then
    every backend mutant of ``faulty.e2e_mutants`` against the e2e workload."""
    import importlib.util

    if importlib.util.find_spec("moelora_runner") is None:
        print("moelora-conformance mutations --engine: needs moelora_runner (the engine) installed", file=sys.stderr)
        return 2
    if not require_fixtures_extra("mutations --engine"):
        return 2
    from moelora_conformance.faulty.e2e_mutants import E2E_MUTANTS
    from moelora_conformance.faulty.engine_campaign import run_e2e_campaign, run_engine_campaign
    from moelora_conformance.faulty.engine_mutants import ENGINE_MUTANTS
    from moelora_conformance.fixtures import build_fixtures

    unknown = set(args.only or []) - set(ENGINE_MUTANTS) - set(E2E_MUTANTS)
    if unknown:
        print(f"moelora-conformance mutations: unknown {sorted(unknown)}; known "
              f"{sorted({*ENGINE_MUTANTS, *E2E_MUTANTS})}", file=sys.stderr)
        return 2
    only = args.only or [*ENGINE_MUTANTS, *E2E_MUTANTS]

    def progress(r):
        where = f"E06 ({r.message[:90]})" if r.caught else "NOT CAUGHT"
        print(f"{r.name:28s} {where}  {r.seconds:.1f} s; history {r.history}: "
              f"{'caught' if r.history_caught else 'NOT CAUGHT'}", flush=True)

    def e2e_progress(r):
        where = f"{r.property} {r.mode} ({r.message[:90]})" if r.caught else "NOT CAUGHT"
        print(f"{r.name:28s} {where}  {r.seconds:.1f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="moelora-fixtures-") as tmp:
        fixtures = fixtures_or_exit(args.fixtures, "mutations") if args.fixtures else build_fixtures(Path(tmp))
        if fixtures is None:
            return 2
        engine = [n for n in only if n in ENGINE_MUTANTS]
        backends = [n for n in only if n in E2E_MUTANTS]
        results = run_engine_campaign(fixtures, engine, seed=args.seed, progress=progress) if engine else []
        e2e = run_e2e_campaign(fixtures, backends, seed=args.seed, progress=e2e_progress) if backends else []
    return 0 if all(r.caught and r.history_caught for r in results) and all(r.caught for r in e2e) else 1


# Subcommands kept in their own modules register themselves on import.
from moelora_conformance.checkpoint_pass import command as _checkpoint_pass  # noqa: E402, F401
from moelora_conformance.e2e import command as _e2e  # noqa: E402, F401

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
