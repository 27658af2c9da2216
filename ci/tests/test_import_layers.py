"""The packages' imports point the ways DESIGN.md §2 names, read from the code (``ast``, every module of
every ``src`` folder, lazy imports inside functions included).

The allowed edges are §2's list; an import outside it (a kernel importing the runner, a package
importing the suite, a new ``packages/`` → ``reference/`` import) fails here with the file and line, so
the layout cannot drift from the document without one of them changing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Import name → its ``src`` folder (DESIGN.md §2's table).
SOURCES = {
    "moelora_core": ROOT / "packages/core/src/moelora_core",
    "moelora_kernels": ROOT / "packages/kernels/src/moelora_kernels",
    "moelora_backends": ROOT / "packages/backends/src/moelora_backends",
    "moelora_runner": ROOT / "packages/runner/src/moelora_runner",
    "moelora_peers": ROOT / "packages/peers/src/moelora_peers",
    "moelora_reference": ROOT / "reference/src/moelora_reference",
    "moelora_conformance": ROOT / "conformance/src/moelora_conformance",
}

#: Who may import whom among the project's packages (DESIGN.md §2: "Dependencies point one way").
ALLOWED = {
    "moelora_core": set(),
    "moelora_reference": {"moelora_core"},
    "moelora_kernels": {"moelora_core"},
    "moelora_backends": {"moelora_core", "moelora_kernels"},
    "moelora_runner": {"moelora_core", "moelora_kernels", "moelora_backends", "moelora_reference"},
    # the e2e suite drives the engine; the mutation campaigns break the built-in backends and engine
    # parts; the HF check runs the engine's whole model (test below: only those subpackages do)
    "moelora_conformance": {"moelora_core", "moelora_reference", "moelora_runner", "moelora_backends"},
    "moelora_peers": {"moelora_core", "moelora_kernels", "moelora_backends"},
}

#: The one named exception: the engine's CLI may import the suite's fixture factory
#: (``moelora make-fixtures``), which imports no other subpackage of the suite (DESIGN.md §2).
CLI_FIXTURES = ("moelora_runner", "moelora_conformance.fixtures")


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import of a project package in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in SOURCES]


def test_every_package_imports_only_what_design_section_2_names():
    bad = []
    for package, folder in SOURCES.items():
        assert folder.is_dir(), f"{folder} is gone: update DESIGN.md §2 and this test together"
        for path in sorted(folder.rglob("*.py")):
            for line, name in imported_packages(path):
                target = name.split(".")[0]
                if target == package or target in ALLOWED[package]:
                    continue
                if (package, name) == CLI_FIXTURES or (package == CLI_FIXTURES[0]
                                                       and name.startswith(CLI_FIXTURES[1] + ".")):
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "imports DESIGN.md §2 does not name:\n" + "\n".join(bad)


def test_the_fixture_factory_imports_no_other_subpackage_of_the_suite():
    folder = SOURCES["moelora_conformance"] / "fixtures"
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in sorted(folder.rglob("*.py")) for line, name in imported_packages(path)
           if name.startswith("moelora_conformance") and not name.startswith("moelora_conformance.fixtures")]
    assert not bad, "the engine's CLI imports the fixture factory, so it must stand alone:\n" + "\n".join(bad)


#: The suite's subpackages that may import the engine or the built-in backends (DESIGN.md §2).
ENGINE_USERS = ("e2e", "faulty", "hf_check")


def test_the_layer_suite_loads_backends_by_name_only():
    """The layer suite (plugin, properties, harness, strategies, checkpoint pass) judges any backend
    through the protocol: it imports neither the engine nor a built-in backend."""
    folder = SOURCES["moelora_conformance"]
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in sorted(folder.rglob("*.py"))
           if path.relative_to(folder).parts[0] not in ENGINE_USERS
           for line, name in imported_packages(path)
           if name.split(".")[0] in ("moelora_runner", "moelora_backends", "moelora_kernels")]
    assert not bad, "the layer suite must load backends by name:\n" + "\n".join(bad)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The reader finds lazy imports inside functions and ``from`` imports alike."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from moelora_runner.engine import Engine\n    import moelora_kernels.align\n")
    assert imported_packages(f) == [(2, "moelora_runner.engine"), (3, "moelora_kernels.align")]
