"""One request inside the engine: its tokens, how far its KV has been computed, its reservation,
its slot, its generator and what it has produced so far.

A request's tokens are ``prompt + outputs``; ``num_computed`` of them have their K/V in the cache.
Every step feeds it the next ``n`` tokens (a prefill chunk, or the last output token when
decoding) and samples when the step reaches its last known token. So a prefill chunk in the middle
of the prompt samples nothing, the chunk ending the prompt samples the first output token, and a
decode step samples the next one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moelora_core.sentinels import NO_ADAPTER
from moelora_runner.kv_cache import KVAllocation
from moelora_runner.requests import EngineRequest, RequestOutput


@dataclass
class RequestState:
    """The engine's state of one request (see the module doc).

    Attributes:
        request: the validated request. request_id: its id.
        prompt: the prompt's token ids.
        reserve: KV tokens reserved at admission (prompt + ``max_new``).
        max_new: tokens it may generate: ``max_new_tokens``, capped so prompt + output fit the context.
        kv: the reservation (None while waiting). slot: its adapter slot while running
            (``NO_ADAPTER`` for a base request).
        generator: the request's own ``torch.Generator`` seeded by its seed (CPU; sampling happens
            on the host after the forward).
        output: what it has produced so far (returned when it finishes).
    """

    request: EngineRequest
    request_id: str
    prompt: list[int]
    reserve: int
    max_new: int
    arrival: float = field(default_factory=time.perf_counter)
    kv: KVAllocation | None = None
    slot: int = NO_ADAPTER
    num_computed: int = 0
    generator: torch.Generator | None = None
    output: RequestOutput | None = None
    first_scheduled: float | None = None
    first_token: float | None = None

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(self.request.seed)
        req = self.request
        self.output = RequestOutput(
            request_id=self.request_id, adapter=req.adapter, prompt_token_ids=list(self.prompt),
            prompt_logprobs=[None] + [float("nan")] * (len(self.prompt) - 1) if req.prompt_logprobs else None,
            top_logprobs=[] if req.logprobs > 0 else None,
        )

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output.output_token_ids)

    @property
    def remaining(self) -> int:
        """Known tokens whose K/V is not computed yet (prompt left, or the last output token)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """The whole prompt is in the cache: every step now feeds one output token."""
        return self.num_computed >= len(self.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.output.output_token_ids)
