"""Repository-wide pytest setup.

- Load the moelora Hypothesis profile named by MOELORA_PROFILE (default ``dev``) explicitly, so
  Hypothesis never falls back to its built-in ``ci`` profile when CI=true.
- Seed torch's global generator per test from the test's id, so a named test that draws with the
  global generator is reproducible run to run (and still draws different values from its neighbours).
  Property tests draw their values from a seeded ``torch.Generator`` of their own.
- Run the tests marked ``slow`` (the nested suite runs, the mutation campaign: minutes each) first, in
  their collection order, so ``-n 2`` workers do not end on one of them alone (xdist hands tests out
  in collection order).
"""

import zlib

import pytest
import torch

from moelora_conformance.profiles import load_profile

load_profile()


@pytest.fixture(autouse=True)
def _seed_torch_per_test(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: every worker collects the same order, which xdist requires
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
