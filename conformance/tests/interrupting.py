"""A pytest plugin for the suite's own tests: cuts a run off inside one property item, as a time
budget, an interrupt or a dying worker does.

``MOELORA_TEST_CUT=<substring of a node id>`` picks the item; ``MOELORA_TEST_CUT_HOW`` is
``interrupt`` (KeyboardInterrupt, as SIGINT from a budget gives), ``crash`` (the process dies) or
``fail`` (the item fails: with ``-x`` the run stops there).
"""

import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    target = os.environ.get("MOELORA_TEST_CUT")
    if target and target in item.nodeid:
        if os.environ.get("MOELORA_TEST_CUT_HOW") == "crash":
            os._exit(3)
        if os.environ.get("MOELORA_TEST_CUT_HOW") == "fail":
            raise AssertionError("failed on purpose (MOELORA_TEST_CUT_HOW=fail)")
        raise KeyboardInterrupt
    return (yield)
