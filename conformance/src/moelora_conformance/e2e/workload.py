"""The e2e workload (DESIGN.md §9): ragged mixed requests arriving over time, and the driver that
serves them on an engine while recording which path every forward pass took.

:func:`make_workload` draws, from one seed: ``n`` greedy requests (default 64) cycling over the
adapters and base (``None``) in a shuffled order; prompt lengths from 1 up to
``max_prompt_tokens`` (both ends always present, log(length) drawn as log(max)·u², so most prompts are short
and a few are long enough to be chunked over several steps); generation lengths 1 up to
``max_new_tokens`` (``ignore_eos``: each request generates exactly what it drew); arrival steps
spread over the first steps so that new prompts arrive while earlier requests decode (prefill
chunks and decodes share steps), and a burst of requests arriving at one step (a batch with more
requests than most, then as many decodes). Every request asks for prompt logprobs and its top-2 logprobs
(the near-tie margins of the graph-vs-eager and HF comparisons).

:func:`serve` adds request i at step ``arrivals[i]`` (steps with nothing to run are idle steps)
and records every forward as a :class:`StepRecord`: its phase, request count, token count and the
``(mode, reason)`` label the engine's ``moelora_forward_passes_total`` counted for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moelora_conformance.e2e.engine_checks import passes


@dataclass(frozen=True)
class Workload:
    """Requests (request-file dicts, in id order) and the step each arrives at."""

    requests: tuple[dict, ...]
    arrivals: tuple[int, ...]
    seed: int

    def adapters(self) -> set[str | None]:
        return {r.get("adapter") for r in self.requests}


def make_workload(adapters: list[str], *, vocab: int, max_prompt_tokens: int, n: int = 64, max_new_tokens: int = 8,
                  seed: int = 0, arrival_steps: int | None = None, burst: int | None = None) -> Workload:
    """The workload described in the module doc.

    Args:
        adapters: adapter names (each gets about ``n / (len(adapters) + 1)`` requests; base too).
        vocab: token ids are drawn from [2, vocab). max_prompt_tokens: the longest prompt (the
            model's context minus ``max_new_tokens`` for the full range).
        n: requests. max_new_tokens: the longest generation. seed: everything drawn from it.
        arrival_steps: arrivals spread over steps [0, arrival_steps) (default ``n // 2``).
        burst: requests (default ``n // 5``) that arrive together at the middle step, each generating
            ``max_new_tokens``: a step with more requests than most, then decodes of as many.

    Raises:
        ValueError: ``n`` < 2, ``max_prompt_tokens`` < 1 or ``max_new_tokens`` < 1.
    """
    if n < 2 or max_prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(f"workload: n >= 2, max_prompt_tokens >= 1 and max_new_tokens >= 1 needed "
                         f"(got {n}, {max_prompt_tokens}, {max_new_tokens})")
    gen = torch.Generator().manual_seed(seed)
    owners = [[None, *adapters][i % (len(adapters) + 1)] for i in range(n)]
    owners = [owners[i] for i in torch.randperm(n, generator=gen).tolist()]
    # log(length) ~ log(max) * u^2: most prompts short, a long tail up to the maximum (a few are
    # chunked over several steps, and most steps fit a captured bucket); request 0 gets 1 token,
    # request 1 the longest prompt
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    top = math.log(max_prompt_tokens + 1)
    lengths = [max(1, min(max_prompt_tokens, int(math.exp(float(x) ** 2 * top)))) for x in u]
    lengths[0], lengths[1 % n] = 1, max_prompt_tokens
    new_tokens = torch.randint(1, max_new_tokens + 1, (n,), generator=gen).tolist()
    new_tokens[0] = max_new_tokens
    span = arrival_steps if arrival_steps is not None else max(1, n // 2)
    arrivals = torch.randint(0, span, (n,), generator=gen).tolist()
    for i in torch.randperm(n - 2, generator=gen)[:n // 5 if burst is None else burst].tolist():
        arrivals[i + 2], new_tokens[i + 2] = span // 2, max_new_tokens
    requests = []
    for i in range(n):
        ids = torch.randint(2, vocab, (lengths[i],), generator=gen).tolist()
        requests.append(dict(request_id=f"e2e-{i}", prompt_token_ids=ids, adapter=owners[i],
                             max_new_tokens=new_tokens[i], ignore_eos=True, prompt_logprobs=True, logprobs=2))
    return Workload(tuple(requests), tuple(arrivals), seed)


@dataclass(frozen=True)
class StepRecord:
    """One forward of the engine.

    Attributes:
        phase: "prefill" (EXTEND, mixed steps included), "decode" or "idle".
        requests: requests in the step. tokens: tokens computed in it.
        prefill_items, decode_items: requests computing prompt tokens / decoding.
        label: the (mode, reason) the engine's metrics counted for this pass.
    """

    phase: str
    requests: int
    tokens: int
    prefill_items: int
    decode_items: int
    label: tuple[str, str]


@dataclass
class Served:
    """What :func:`serve` saw: outputs in request order, every forward, and the engine's counters."""

    outputs: list
    steps: list[StepRecord] = field(default_factory=list)
    passes: dict = field(default_factory=dict)
    loads: int = 0
    evictions: int = 0


def serve(engine, workload: Workload) -> Served:
    """Serve ``workload`` on ``engine`` (module doc); the outputs in request order and a record of
    every forward pass (wraps ``engine.runner.forward`` for the run and restores it).

    Raises:
        AssertionError: a forward pass was counted other than exactly once.
    """
    steps: list[StepRecord] = []
    inner = engine.runner.forward

    def forward(plan):
        before = passes(engine)
        logits = inner(plan)
        after = passes(engine)
        changed = [(k, after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)]
        assert len(changed) == 1 and changed[0][1] == 1, f"one forward counted as {changed}"
        (phase, mode, reason), _ = changed[0]
        items = plan.batch.items
        steps.append(StepRecord(phase, len(items), plan.host.num_tokens,
                                sum(not i.state.is_decoding for i in items), sum(i.state.is_decoding for i in items),
                                (mode, reason)))
        return logits

    engine.runner.forward = forward
    try:
        requests, arrivals = workload.requests, workload.arrivals
        outputs, step = {}, 0
        pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
        while pending or engine.has_unfinished():
            while pending and arrivals[pending[0]] <= step:
                engine.add_request(requests[pending.pop(0)])
            for out in engine.step():
                outputs[out.request_id] = out
            step += 1
    finally:
        engine.runner.forward = inner
    m = engine.metrics_
    return Served([outputs[r["request_id"]] for r in requests], steps, passes(engine),
                  int(m.value("moelora_adapter_loads_total")), int(m.value("moelora_adapter_evictions_total")))
