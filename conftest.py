"""Repository-wide pytest setup: load the moelora Hypothesis profile named by MOELORA_PROFILE
(default ``dev``) explicitly, so Hypothesis never falls back to its built-in ``ci`` profile."""

from moelora_conformance.profiles import load_profile

load_profile()
