"""Choosing the next token of one request from its logits, on the host, after the forward.

- greedy (``temperature == 0``): ``argmax`` of the logits (the first maximum on ties, as
  ``torch.argmax`` and transformers' greedy search).
- sampled: logits / temperature → top-k (keep every token at least as likely as the k-th) →
  top-p (keep the smallest most-likely set whose mass reaches p, at least one token) → softmax →
  one ``torch.multinomial`` draw from the request's own generator. The generator is seeded by the
  request's ``seed`` and used by nothing else, so a request's tokens depend on its own logits
  only, never on its batch mates or on the order requests arrive in.

Reported logprobs are those of the model's distribution (fp32 ``log_softmax`` of the raw logits,
before temperature / top-k / top-p), as vLLM reports them.
"""

from __future__ import annotations

import torch

from moelora_runner.requests import EngineRequest


def sample_token(logits: torch.Tensor, request: EngineRequest, generator: torch.Generator) -> int:
    """The next token of ``request`` from its fp32 logits [V] (CPU).

    Args:
        logits: [V] fp32 logits of the row that predicts the next token.
        request: its sampling parameters.
        generator: the request's own CPU generator (advanced by one draw when sampling).
    """
    if request.greedy:
        return int(torch.argmax(logits))
    scaled = logits / request.temperature
    V = scaled.numel()
    if 0 < request.top_k < V:
        kth = torch.topk(scaled, request.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if request.top_p < 1.0:
        probs_sorted, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True)
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        drop_sorted = mass_before >= request.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[dict[str, float | int]]:
    """The ``n`` most likely tokens of a [V] logprob row, descending, as ``{"token_id", "logprob"}``."""
    values, ids = torch.topk(logprobs, min(n, logprobs.numel()))
    return [{"token_id": int(i), "logprob": float(v)} for v, i in zip(values.tolist(), ids.tolist())]
