"""``moelora-conformance``: the conformance command line, one subcommand per job.

Subcommands register themselves in :data:`SUBCOMMANDS` with :func:`subcommand`; each adds its own
arguments and returns an exit status. Built in here:

- ``make-fixtures DIR``: build the local HF MoE models and PEFT adapters (extra ``fixtures``).
- ``hf-check [--fixtures DIR]``: the oracle against HF transformers + PEFT on every fixture; prints
  the table and exits 1 on any failure (fixtures are built into a temporary directory unless given).

Both exit 2 when the ``fixtures`` extra (transformers + peft) is not installed.

A later module adds ``run`` and ``report`` the same way::

    @subcommand("report", help="render the support matrix")
    def add_report(parser): ...          # declare arguments; return the handler
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Subcommand:
    """A registered subcommand: ``configure(parser)`` declares its arguments and returns its handler."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], Handler]


#: name → Subcommand, in registration order.
SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(name: str, *, help: str) -> Callable[[Callable[[argparse.ArgumentParser], Handler]], Callable]:
    """Register a subcommand (decorator on its ``configure`` function).

    Raises:
        ValueError: the name is already registered.
    """

    def register(configure: Callable[[argparse.ArgumentParser], Handler]):
        if name in SUBCOMMANDS:
            raise ValueError(f"subcommand {name!r} is already registered")
        SUBCOMMANDS[name] = Subcommand(name, help, configure)
        return configure

    return register


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    """The top-level parser and the handler of each subcommand."""
    parser = argparse.ArgumentParser(prog="moelora-conformance",
                                     description="moelora's conformance suite for MoE multi-LoRA backends")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    handlers = {}
    for sub in SUBCOMMANDS.values():
        handlers[sub.name] = sub.configure(subs.add_parser(sub.name, help=sub.help, description=sub.help))
    return parser, handlers


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``moelora-conformance`` (and ``python -m moelora_conformance``)."""
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    return handlers[args.command](args)


def _require_fixtures_extra(command: str) -> bool:
    """Whether transformers and peft are importable; if not, say how to get them."""
    import importlib.util

    missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"moelora-conformance {command}: needs the 'fixtures' extra ({', '.join(missing)} missing): "
              "pip install 'moelora-conformance[fixtures]'", file=sys.stderr)
    return not missing


# --- built-in subcommands -----------------------------------------------------------------------


@subcommand("make-fixtures", help="build the local HF MoE models and PEFT adapters (needs the 'fixtures' extra)")
def _make_fixtures(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("directory", type=Path, help="output directory (models/, adapters/, bad_adapters/, "
                        "manifest.json)")

    def run(args: argparse.Namespace) -> int:
        if not _require_fixtures_extra("make-fixtures"):
            return 2
        from moelora_conformance.fixtures import build_fixtures

        fixtures = build_fixtures(args.directory)
        m = fixtures.manifest
        print(f"built {len(m['models'])} models, {len(m['adapters'])} adapters, {len(m['bad_adapters'])} bad "
              f"adapters in {args.directory} (manifest.json)")
        return 0

    return run


@subcommand("hf-check", help="check the oracle and the checkpoint readers against HF transformers + PEFT")
def _hf_check(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="a directory built by make-fixtures (default: build into a temporary directory)")
    parser.add_argument("--adapter", action="append", default=None, help="check only this adapter (repeatable)")

    def run(args: argparse.Namespace) -> int:
        if not _require_fixtures_extra("hf-check"):
            return 2
        from moelora_conformance.fixtures import build_fixtures, load_fixtures
        from moelora_conformance.hf_check import render, run_hf_check

        with tempfile.TemporaryDirectory(prefix="moelora-fixtures-") as tmp:
            fixtures = load_fixtures(args.fixtures) if args.fixtures else build_fixtures(Path(tmp))
            rows = run_hf_check(fixtures, adapters=args.adapter)
        return 0 if render(rows) else 1

    return run


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
