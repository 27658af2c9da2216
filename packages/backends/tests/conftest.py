"""Backend-test setup: tests marked ``interpreter`` launch Triton kernels on CPU tensors, so they run
only under ``TRITON_INTERPRET=1`` (the CPU CI); on a GPU machine without it they are skipped (the
conformance suite covers the backends there: the conformance cells of ``ci/matrix.toml``). One known warning of the
Triton 3.6 interpreter is silenced (``int(array)`` of a 1-element array, deprecated by numpy)."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_configure(config):
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Conversion of an array with ndim > 0 to a scalar is deprecated:DeprecationWarning",
    )


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="launches Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
    for item in items:  # this directory's tests only (the hook sees the whole session)
        if HERE in Path(item.path).parents and item.get_closest_marker("interpreter") is not None:
            item.add_marker(skip)
