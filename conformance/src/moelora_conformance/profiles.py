"""Hypothesis profiles with moelora's size caps (DESIGN.md §7), loaded explicitly by name.

A profile is two things: Hypothesis settings (examples, phases, deadline) and size caps that the
strategies read (tokens, requests, H, I, E, top_k, R, dtypes, whether real model shapes are drawn).

Profiles are loaded by name (``load_profile("interpret")``), never implicitly: with ``CI=true``
Hypothesis would otherwise load its own built-in ``ci`` profile. ``MOELORA_PROFILE`` picks the
profile for test sessions (the root ``conftest.py`` and the conformance plugin read it).

- ``interpret``: CPU CI under the Triton interpreter: <= 96 tokens, H and I <= 64, E <= 8,
  top_k <= 2, R <= 16, fp32/fp16, 15 examples.
- ``dev``: a developer's CPU run: past every interpret cap (<= 160 tokens, H <= 128, I <= 96,
  E <= 16, top_k <= 4, R <= 32), fp32/fp16, 50 examples.
- ``gpu``: the H200: Qwen3-30B-A3B layer shapes among the draws, bf16/fp16/fp32, 100 examples.
- ``soak``: long CPU/GPU runs: the gpu caps with 2000 examples.
``MOELORA_MAX_EXAMPLES=N`` overrides the profile's example count (caps unchanged).

- ``repro``: replay one failure: ``--hypothesis-seed`` from the failure's repro line, 1 example per
  explicit case + the seed's generation, no shrinking.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, Phase, settings


@dataclass(frozen=True)
class SizeCaps:
    """Upper bounds the strategies respect.

    Attributes:
        max_tokens: tokens per batch.
        max_requests: requests per batch (>= 33 so batches past the public 32-request cap occur).
        max_hidden: H. max_intermediate: I. max_experts: E. max_top_k: top_k. max_rank: R.
        max_loras: adapter slots.
        dtypes: dtypes drawn.
        model_shapes: also draw real model layer shapes (e.g. Qwen3-30B-A3B: H 2048, I 768,
            E 128, top-8) — GPU only.
        large_offsets: P01's eager items also draw the large-offset case (element offsets past
            2³¹: ``strategies.large_offsets``) — GPU only.
    """

    max_tokens: int
    max_requests: int
    max_hidden: int
    max_intermediate: int
    max_experts: int
    max_top_k: int
    max_rank: int
    max_loras: int
    dtypes: tuple[torch.dtype, ...]
    model_shapes: bool = False
    large_offsets: bool = False


@dataclass(frozen=True)
class Profile:
    """A named profile: Hypothesis settings plus size caps.

    Attributes:
        shrink_seconds: how long Hypothesis may shrink one failure (None: its own five minutes;
            the conformance plugin applies it through :mod:`moelora_conformance.hypothesis_compat`).
    """

    name: str
    caps: SizeCaps
    max_examples: int
    phases: tuple[Phase, ...] = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
    shrink_seconds: float | None = None

    def settings(self, *, derandomize: bool = False) -> settings:
        """Hypothesis settings of the profile; ``derandomize`` fixes the search (CI).

        ``report_multiple_bugs``: each distinct failure (exception type and place) is shrunk on its
        own and reported with its own example, so a shrunk example never slips from the failure
        found to another one.
        """
        return settings(
            max_examples=self.max_examples,
            phases=self.phases,
            deadline=None,
            derandomize=derandomize,
            print_blob=True,
            report_multiple_bugs=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.function_scoped_fixture],
            database=None,
        )


_CPU_CAPS = SizeCaps(
    max_tokens=96, max_requests=128, max_hidden=64, max_intermediate=64, max_experts=8,
    max_top_k=2, max_rank=16, max_loras=4, dtypes=(torch.float32, torch.float16),
)
# dev goes past every interpret cap (top_k 4 > 2, R 32 > 16, H 128 > 64, I 96 > 64, E 16 > 8), so
# faults that hide within the CI caps (a fixed 16-row rank tile, a single 64-wide K tile, LoRA on the
# first two experts only: faulty/beyond_caps.py) are caught on a CPU too
_DEV_CAPS = SizeCaps(
    max_tokens=160, max_requests=128, max_hidden=128, max_intermediate=96, max_experts=16,
    max_top_k=4, max_rank=32, max_loras=4, dtypes=(torch.float32, torch.float16),
)
_GPU_CAPS = SizeCaps(
    max_tokens=8192, max_requests=256, max_hidden=2048, max_intermediate=768, max_experts=128,
    max_top_k=8, max_rank=64, max_loras=8, dtypes=(torch.bfloat16, torch.float16, torch.float32),
    model_shapes=True, large_offsets=True,
)

PROFILES: dict[str, Profile] = {
    # shrink bounds: a counterexample within a minute on two cores (interpret), longer where a run
    # is allowed to take longer
    "interpret": Profile("interpret", _CPU_CAPS, max_examples=15, shrink_seconds=20),
    "dev": Profile("dev", _DEV_CAPS, max_examples=50, shrink_seconds=60),
    "gpu": Profile("gpu", _GPU_CAPS, max_examples=100, shrink_seconds=120),
    "soak": Profile("soak", _GPU_CAPS, max_examples=2000),
    "repro": Profile("repro", _CPU_CAPS, max_examples=1, phases=(Phase.explicit, Phase.generate)),
}

_current: Profile | None = None


def load_profile(name: str | None = None) -> Profile:
    """Register and load profile ``name`` (default: ``$MOELORA_PROFILE`` or ``dev``).

    Raises:
        KeyError: unknown profile name (the message lists the known ones).
    """
    global _current
    name = name or os.environ.get("MOELORA_PROFILE", "dev")
    if name not in PROFILES:
        raise KeyError(f"unknown moelora profile {name!r}; known: {sorted(PROFILES)}")
    profile = PROFILES[name]
    override = os.environ.get("MOELORA_MAX_EXAMPLES")
    if override:
        # One knob to bound a run (e.g. a GPU call with a time limit) without another profile.
        profile = dataclasses.replace(profile, max_examples=int(override))
    settings.register_profile(f"moelora-{name}", profile.settings(derandomize=on_ci()))
    settings.load_profile(f"moelora-{name}")
    _current = profile
    return profile


def on_ci() -> bool:
    """True where ``$CI`` is set to anything but "", "0", "false" or "no" (GitHub Actions, GitLab CI,
    Travis and CircleCI set it; ``.ci/run`` sets it). Then every profile derandomizes, as
    Hypothesis' own ``ci`` profile does: a CI run is a gate and must give the same verdict on the
    same commit, while the random search that finds new faults belongs to local, ``dev`` and
    ``soak`` runs. (CI once went red on a random draw that exposed a wrong bound of the check
    itself, 2026-11-29; a test now builds the same kind of case on purpose.)"""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def current_profile() -> Profile:
    """The loaded profile (loads the default one on first use)."""
    return _current if _current is not None else load_profile()
