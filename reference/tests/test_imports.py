"""moelora_reference must not be derived from the code it is checked against: importing every one of
its modules loads neither transformers nor peft (DESIGN.md §2)."""

import pkgutil
import subprocess
import sys

import moelora_reference


def test_no_module_imports_transformers_or_peft():
    names = sorted(m.name for m in pkgutil.walk_packages(moelora_reference.__path__, "moelora_reference."))
    assert {"moelora_reference.oracle", "moelora_reference.backend", "moelora_reference.align"} <= set(names)
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
