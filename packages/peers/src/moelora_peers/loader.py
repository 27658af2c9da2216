"""Import a peer's kernel modules from its released files without running the peer's package.

SGLang's and vLLM's kernel modules sit deep inside a server package: ``import sglang`` (its
``__init__``) starts the server's import graph, and the modules we want import platform checks,
custom-op registration, capture flags and TP helpers at their top. :class:`PeerImporter` is a
``sys.meta_path`` finder for one peer's top-level name (``sglang`` or ``vllm``) that decides, per
module name:

- a **stub** (``moelora_peers.stubs.<peer>_<dotted_name>``): a small module of ours standing in for
  a server module (conformance/docs/peers.md lists each one and what it provides);
- a **shell package**: a package whose ``__init__.py`` does not run (``__path__`` only), so the
  real files below it can be imported (``sglang/__init__.py`` never runs);
- a package whose ``__init__.py`` runs (named in ``run_init``: small inits the kernels import from);
- the **peer's own file**, unchanged, everything else; a name with no file raises
  ``ModuleNotFoundError`` as usual.

Every peer file loaded is recorded (:attr:`PeerImporter.loaded`), for the report header and for the
GPU folder (``packages/peers/scripts/build_gpu_folder.py`` copies exactly those files).

Where the files come from: ``MOELORA_PEERS_ROOT`` (a folder holding ``sglang/``, ``vllm/`` and their
``*.dist-info``; what the GPU folder is) or else the installed distribution (``pip install
--no-deps sglang==0.5.23``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from moelora_core.errors import InvalidFieldError

#: The environment variable naming a folder of peer files (``<root>/sglang``, ``<root>/vllm``).
ROOT_ENV = "MOELORA_PEERS_ROOT"


@dataclass(frozen=True)
class PeerDist:
    """Where one peer's files are and which release they are.

    Attributes:
        name: the top-level package name (``"sglang"``, ``"vllm"``).
        root: the folder holding the ``name`` package directory.
        version: the release's version string (from its ``*.dist-info``).
        requires: the release's ``Requires-Dist`` lines (its own pins of torch, transformers, ...).
    """

    name: str
    root: Path
    version: str
    requires: tuple[str, ...]

    def pins(self, *projects: str) -> dict[str, str]:
        """The release's own requirement lines for ``projects`` (e.g. torch, transformers)."""
        out = {}
        for line in self.requires:
            head = line.split(";")[0].strip()
            for p in projects:
                rest = head[len(p):]
                if head.lower().startswith(p) and (not rest or rest[0] in "=<>!~ ["):
                    out[p] = head
        return out


def find_peer(name: str) -> PeerDist:
    """The files and release of peer ``name``: ``$MOELORA_PEERS_ROOT`` if set, else the installed one.

    Raises:
        InvalidFieldError: the peer is neither in ``$MOELORA_PEERS_ROOT`` nor installed.
    """
    override = os.environ.get(ROOT_ENV)
    dists = (importlib.metadata.distributions(path=[override]) if override
             else importlib.metadata.distributions())
    for dist in dists:
        if (dist.metadata["Name"] or "").lower() != name:
            continue
        root = Path(override) if override else Path(str(dist.locate_file("")))
        if (root / name).is_dir():
            return PeerDist(name, root, dist.version, tuple(dist.requires or ()))
    where = f"${ROOT_ENV}={override}" if override else "the installed packages"
    raise InvalidFieldError(
        "peer", f"{name} not found in {where}: install it with `pip install --no-deps` (nox -s peers does) or "
        f"point {ROOT_ENV} at a folder built by packages/peers/scripts/build_gpu_folder.py")


class _ShellLoader(importlib.abc.Loader):
    """A package whose ``__init__.py`` does not run: only its ``__path__``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = f"shell of {module.__name__} (moelora_peers.loader: its __init__.py does not run)"


class _StubLoader(importlib.abc.Loader):
    """A server module replaced by one of ours: the new module gets the stub's names."""

    def __init__(self, stub: str) -> None:
        self.stub = stub

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        stub = importlib.import_module(self.stub)
        for key, value in vars(stub).items():
            if key not in ("__name__", "__spec__", "__loader__", "__file__", "__cached__", "__package__"):
                module.__dict__[key] = value
        module.__stub__ = self.stub
        if not hasattr(module, "__path__") and getattr(stub, "IS_PACKAGE", False):
            module.__path__ = []


@dataclass
class PeerImporter(importlib.abc.MetaPathFinder):
    """The ``sys.meta_path`` finder of one peer (module docstring).

    Args:
        dist: the peer's files and release.
        stubs: peer module name → the stub module of ours that replaces it.
        run_init: packages whose ``__init__.py`` runs (every other package is a shell).
    """

    dist: PeerDist
    stubs: dict[str, str]
    run_init: frozenset[str] = frozenset()
    loaded: list[str] = field(default_factory=list)

    def find_spec(self, fullname: str, path: Iterable[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top != self.dist.name:
            return None
        stub = self.stubs.get(fullname)
        if stub is not None:
            spec = importlib.machinery.ModuleSpec(fullname, _StubLoader(stub))
            return spec
        base = self.dist.root.joinpath(*fullname.split("."))
        if base.is_dir():
            init = base / "__init__.py"
            if fullname in self.run_init and init.is_file():
                self.loaded.append(str(init.relative_to(self.dist.root)))
                return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(base)])
            # origin names the package's own __init__.py (what the peer's code reads to find its
            # files, e.g. SGLang's JIT sources), though the shell loader never runs it.
            spec = importlib.machinery.ModuleSpec(fullname, _ShellLoader(), origin=str(init), is_package=True)
            spec.submodule_search_locations = [str(base)]
            return spec
        file = base.with_suffix(".py")
        if file.is_file():
            self.loaded.append(str(file.relative_to(self.dist.root)))
            return importlib.util.spec_from_file_location(fullname, file)
        if any(name.startswith(fullname + ".") for name in self.stubs):
            # a package that holds only stubbed modules (absent from a partial copy such as the GPU folder)
            spec = importlib.machinery.ModuleSpec(fullname, _ShellLoader(), is_package=True)
            spec.submodule_search_locations = [str(base)]
            return spec
        return None


_INSTALLED: dict[str, PeerImporter] = {}


def install(name: str, stubs: dict[str, str], run_init: Iterable[str] = ()) -> PeerImporter:
    """Put peer ``name``'s finder first on ``sys.meta_path`` (once per process) and return it.

    Raises:
        InvalidFieldError: the peer is not found (:func:`find_peer`), or a module of the peer was
            imported before by other means (its ``__init__`` may have run: the stubs would not apply).
    """
    importer = _INSTALLED.get(name)
    if importer is not None:
        return importer
    early = sorted(m for m in sys.modules if m == name or m.startswith(name + "."))
    if early:
        raise InvalidFieldError(
            "peer", f"{name} modules were imported before moelora_peers installed its finder ({early[:3]}...): "
            "the peer's package __init__ may have run; import moelora_peers first")
    importer = PeerImporter(find_peer(name), dict(stubs), frozenset(run_init))
    sys.meta_path.insert(0, importer)
    _INSTALLED[name] = importer
    return importer


def import_peer(importer: PeerImporter, module: str) -> types.ModuleType:
    """Import ``module`` of the peer through its finder (``install`` first)."""
    if module.partition(".")[0] != importer.dist.name:
        raise InvalidFieldError("module", f"{module!r} is not a module of {importer.dist.name}")
    return importlib.import_module(module)
