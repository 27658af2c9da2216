"""The batches of the real-checkpoint pass: more than 32 requests, extend lengths above 1, every
adapter slot and base requests mixed.

- :func:`extend_batch`: an EXTEND batch of ``num_requests`` requests of 2–6 tokens, some of them
  chunked prefills (a prefix already cached); slots dealt round-robin over the adapters and
  ``NO_ADAPTER`` then shuffled, so every adapter has several requests and neighbours differ;
- :func:`decode_batch`: a DECODE batch of ``num_requests`` requests of ``tokens_per_request`` = 2
  tokens each (speculative verification), the same slot dealing.

Deterministic: a ``random.Random`` seeded by the caller.
"""

from __future__ import annotations

import random

from moelora_core.batch import BatchSpec, Request
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER

#: Requests per pass batch (past the 32-request cap some engines had).
PASS_REQUESTS = 40
#: Tokens per request in the pass's DECODE batch.
DECODE_TOKENS = 2


def _slots(num_requests: int, num_adapters: int, rng: random.Random) -> list[int]:
    choices = [*range(num_adapters), NO_ADAPTER]
    slots = [choices[i % len(choices)] for i in range(num_requests)]
    rng.shuffle(slots)
    return slots


def extend_batch(lora_ranks: tuple[int, ...], scalings: tuple[float, ...], *, num_adapters: int,
                 num_requests: int = PASS_REQUESTS, seed: int = 0) -> BatchSpec:
    """A mixed EXTEND batch over slots ``0..num_adapters-1`` and base requests (module doc)."""
    rng = random.Random(seed)
    requests = [Request(slot, rng.randint(2, 6), rng.choice((0, 0, rng.randint(1, 512))))
                for slot in _slots(num_requests, num_adapters, rng)]
    return BatchSpec(ForwardMode.EXTEND, requests, len(lora_ranks), lora_ranks, scalings)


def decode_batch(lora_ranks: tuple[int, ...], scalings: tuple[float, ...], *, num_adapters: int,
                 num_requests: int = PASS_REQUESTS, tokens_per_request: int = DECODE_TOKENS,
                 seed: int = 0) -> BatchSpec:
    """A DECODE batch of ``tokens_per_request`` tokens per request over the same slots (module doc)."""
    rng = random.Random(seed + 1)
    requests = [Request(slot, tokens_per_request, rng.randint(1, 512))
                for slot in _slots(num_requests, num_adapters, rng)]
    return BatchSpec(ForwardMode.DECODE, requests, len(lora_ranks), lora_ranks, scalings)
