"""The subcommand registry of ``moelora-conformance`` (:mod:`moelora_conformance.cli` builds the parser).

A subcommand registers itself with :func:`subcommand`; modules that hold subcommands import this
module, never ``cli`` (which imports them to register them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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


def require_fixtures_extra(command: str) -> bool:
    """Whether transformers and peft are importable; if not, say how to get them."""
    import importlib.util

    missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"moelora-conformance {command}: needs the 'fixtures' extra ({', '.join(missing)} missing): "
              "pip install 'moelora-conformance[fixtures]'", file=sys.stderr)
    return not missing


def fixtures_or_exit(directory, command: str):
    """``load_fixtures(directory)``, or None after printing why the directory is not usable."""
    from moelora_conformance.fixtures import FixturesError, load_fixtures

    try:
        return load_fixtures(directory)
    except FixturesError as exc:
        print(f"moelora-conformance {command}: {exc}", file=sys.stderr)
        return None


def user_files_or_exit(args, command: str):
    """The user's ``--model`` / ``--adapter NAME=DIR`` files as a fixture set
    (:func:`moelora_conformance.user_files.user_fixture_set`); None when no ``--model`` was given;
    False after printing why they are not usable (the caller exits 2)."""
    from moelora_conformance.user_files import UserFilesError, parse_adapters, user_fixture_set

    adapters_given = getattr(args, "adapter", None)
    if args.model is None:
        if adapters_given:
            print(f"moelora-conformance {command}: --adapter NAME=DIR needs --model DIR (to check only some "
                  "fixture adapters, use --only-adapter NAME)", file=sys.stderr)
            return False
        return None
    if getattr(args, "fixtures", None) is not None:
        print(f"moelora-conformance {command}: give either --fixtures or --model, not both", file=sys.stderr)
        return False
    try:
        fixtures = user_fixture_set(args.model, parse_adapters(adapters_given))
    except UserFilesError as exc:
        print(f"moelora-conformance {command}: {exc}", file=sys.stderr)
        return False
    for entry in fixtures.manifest["adapters"].values():  # at load: no-op adapters, config notes
        for warning in entry.get("warnings", []):
            print(f"moelora-conformance {command}: warning: {warning}", file=sys.stderr)
    return fixtures


def per_backend(values: list[str] | None, backend: str) -> str | None:
    """The value for ``backend`` from repeatable ``[BACKEND=]VALUE`` options (``--manifest``,
    ``--dtypes``, ...): a value named for the backend wins, else the first bare value (every
    backend), else None."""
    chosen = None
    for value in values or []:
        name, sep, rest = value.partition("=")
        if not sep:
            chosen = chosen or value
        elif name == backend:
            return rest
    return chosen


def per_backend_path(base: Path | None, backend: str, many: bool) -> Path | None:
    """Where ``backend``'s report goes when ``base`` (``--json`` / ``--junitxml``) is given: ``base``
    itself for one backend; for several, ``base`` with the backend's name (non-alphanumerics as
    ``-``) after its stem (``e2e.json`` → ``e2e-my_pkg-factory.json``); None without ``base``."""
    if base is None:
        return None
    if not many:
        return base
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in backend)
    return base.with_name(f"{base.stem}-{safe}{base.suffix or '.json'}")
