"""Repository-wide pytest setup.

- Load the moelora Hypothesis profile named by MOELORA_PROFILE (default ``dev``) explicitly, so
  Hypothesis never falls back to its built-in ``ci`` profile when CI=true.
- Seed torch's global generator per test from the test's id, so a named test that draws with the
  global generator is reproducible run to run (and still draws different values from its neighbours).
  Property tests draw their values from a seeded ``torch.Generator`` of their own.
"""

import zlib

import pytest
import torch

from moelora_conformance.profiles import load_profile

load_profile()


@pytest.fixture(autouse=True)
def _seed_torch_per_test(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
