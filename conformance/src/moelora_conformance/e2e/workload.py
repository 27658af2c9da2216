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

Two scenes are put in (reshaping the draw, never adding requests): the *chunk scene* (given the step
budget B): at three quarters of the arrival span, in a window other arrivals are moved out of, request
D (2 prompt tokens) starts decoding and request P arrives a step later with 2(B-1) + 5B/6 prompt tokens
(or the longest prompt allowed): P's first, middle and last chunks run next to D's decodes, the middle
and last on the same prefill bucket with the same requests in the same slots and a changed chunk layout
(P's rows end earlier: a backend that memoises a graph's metadata on the request → slot mapping keeps
the middle chunk's extend lengths there). The *reload*:
at a quarter of the span, the adapter with the most later requests is reloaded with new weights of its
exact config (:func:`reloaded_weights`, RL weight sync), once no request uses it.

:func:`serve` adds request i at step ``arrivals[i]`` (steps with nothing to run are idle steps)
and records every forward as a :class:`StepRecord`: its phase, request count, token count and the
``(mode, reason)`` label the engine's ``moelora_forward_passes_total`` counted for it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from moelora_conformance.e2e.engine_checks import passes
from moelora_core.checkpoint import AdapterWarning


@dataclass(frozen=True)
class Workload:
    """Requests (request-file dicts, in id order) and the step each arrives at."""

    requests: tuple[dict, ...]
    arrivals: tuple[int, ...]
    seed: int
    #: (step, adapter): from that step on (once no request uses it), the adapter is reloaded with new
    #: weights of the same config (RL weight sync); None: no reload.
    reload: tuple[int, str] | None = None
    #: indices of the chunk scene's (decoding, chunked) requests, or None (module doc).
    scene: tuple[int, int] | None = None

    def adapters(self) -> set[str | None]:
        return {r.get("adapter") for r in self.requests}


def make_workload(adapters: list[str], *, vocab: int, max_prompt_tokens: int, n: int = 64, max_new_tokens: int = 8,
                  seed: int = 0, arrival_steps: int | None = None, burst: int | None = None,
                  budget: int | None = None, reload: bool = True) -> Workload:
    """The workload described in the module doc.

    Args:
        adapters: adapter names (each gets about ``n / (len(adapters) + 1)`` requests; base too).
        vocab: token ids are drawn from [2, vocab). max_prompt_tokens: the longest prompt (the
            model's context minus ``max_new_tokens`` for the full range).
        n: requests. max_new_tokens: the longest generation. seed: everything drawn from it.
        arrival_steps: arrivals spread over steps [0, arrival_steps) (default ``n // 2``).
        burst: requests (default ``n // 5``) that arrive together at the middle step, each generating
            ``max_new_tokens``: a step with more requests than most, then decodes of as many.
        budget: the engine's step token budget: with it (and ``n >= 8``), the last two requests are the
            chunk scene (module doc). reload: reload one adapter with new weights of its config at a
            quarter of the arrival span (the adapter with the most requests arriving after it).

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
    scene = None
    if budget is not None and n >= 8 and max_new_tokens >= 4 and max_prompt_tokens > budget:
        # the chunk scene (module doc): D (2 prompt tokens) arrives at step a in a quiet window, P one step
        # later with a prompt of two full chunks and a last one past half the budget (or what the longest
        # prompt allows): P's first, middle and last chunks run next to D's decodes, the last on the same
        # bucket as the middle one with the same requests in the same slots (D runs first: the scheduler
        # serves running requests before it admits P, and P's chunks take the budget D leaves)
        d, p = n - 2, n - 1
        a = max(1, span * 3 // 4)
        lengths[d], new_tokens[d], arrivals[d] = 2, max_new_tokens, a
        lengths[p], new_tokens[p], arrivals[p] = min(max_prompt_tokens, 2 * (budget - 1) + budget * 5 // 6), 1, a + 1
        for i in range(n - 2):  # the window [a - max_new_tokens, a + 4) is kept for the scene
            if a - max_new_tokens <= arrivals[i] < a + 4:
                arrivals[i] = a + 4 + (arrivals[i] - a + max_new_tokens) % 4
        scene = (d, p)
    reload_at = None
    if reload and adapters:
        step = max(1, span // 4)
        later = [owners[i] for i in range(n) if arrivals[i] > step and owners[i] is not None]
        if later:
            reload_at = (step, max(sorted(set(later)), key=later.count))
    requests = []
    for i in range(n):
        ids = torch.randint(2, vocab, (lengths[i],), generator=gen).tolist()
        requests.append(dict(request_id=f"e2e-{i}", prompt_token_ids=ids, adapter=owners[i],
                             max_new_tokens=new_tokens[i], ignore_eos=True, prompt_logprobs=True, logprobs=2))
    return Workload(tuple(requests), tuple(arrivals), seed, reload_at, scene)


@dataclass(frozen=True)
class StepRecord:
    """One forward of the engine.

    Attributes:
        phase: "prefill" (EXTEND, mixed steps included), "decode" or "idle".
        requests: requests in the step. tokens: tokens computed in it.
        prefill_items, decode_items: requests computing prompt tokens / decoding.
        label: the (mode, reason) the engine's metrics counted for this pass.
        layout: per item in batch order (request id, slot, tokens, prefix length, kind): kind is "decode",
            "whole" (a whole prompt), or a prompt chunk "first", "middle", "last".
        bucket: the graph bucket replayed (tokens for prefill, requests for decode), None when eager.
        hot: requests of the step in a slot that was empty when its bucket was captured.
        guarded: the pass ran under the host-sync guard.
    """

    phase: str
    requests: int
    tokens: int
    prefill_items: int
    decode_items: int
    label: tuple[str, str]
    layout: tuple[tuple[str, int, int, int, str], ...] = ()
    bucket: int | None = None
    hot: int = 0
    guarded: bool = False

    @property
    def chunks(self) -> set[str]:
        """The prompt chunk kinds of the step ("first", "middle", "last")."""
        return {k for *_, k in self.layout if k in ("first", "middle", "last")}

    def same_slots(self, other: StepRecord) -> bool:
        """Same requests on the same slots, in the same order."""
        return [x[:2] for x in self.layout] == [x[:2] for x in other.layout]

    def same_layout(self, other: StepRecord) -> bool:
        """Same requests, slots, token counts and prefixes."""
        return [x[:4] for x in self.layout] == [x[:4] for x in other.layout]


@dataclass
class Served:
    """What :func:`serve` saw: outputs in request order, every forward, and the engine's counters.

    ``reference``: request id → the adapter name of its HF + PEFT reference ("NAME@reloaded" for a request
    added after the reload of NAME); ``reloads``: same-config reloads done; ``reloaded_requests``: requests
    served with reloaded weights."""

    outputs: list
    steps: list[StepRecord] = field(default_factory=list)
    passes: dict = field(default_factory=dict)
    loads: int = 0
    evictions: int = 0
    reference: dict = field(default_factory=dict)
    reloads: int = 0
    reloaded_requests: int = 0


#: The HF + PEFT reference name of an adapter's reloaded weights.
RELOADED = "{}@reloaded"


def _kind(state, n: int) -> str:
    if state.is_decoding:
        return "decode"
    start, prompt = state.num_computed, len(state.prompt)
    if start == 0:
        return "whole" if n >= prompt else "first"
    return "last" if start + n >= prompt else "middle"


def _graph_runner(engine, phase: str):
    return engine.runner.decode_graph if phase == "decode" else engine.runner.prefill_graph


def serve(engine, workload: Workload, *, reload_weights: tuple | None = None, probe=None) -> Served:
    """Serve ``workload`` on ``engine`` (module doc); the outputs in request order and a record of
    every forward pass (wraps ``engine.runner.forward`` for the run and restores it).

    ``reload_weights``: (tensors, config) that ``workload.reload``'s adapter is reloaded with
    (``Engine.load_adapter_from_tensors``) at its step, once no request uses it; its requests arriving
    while the reload waits are held back until it is done (and then served with the new weights).
    ``probe``: a :class:`~.locate.Probe` installed on ``engine``, told after every step.

    Raises:
        AssertionError: a forward pass was counted other than exactly once.
    """
    steps: list[StepRecord] = []
    inner = engine.runner.forward
    captured_slots: dict[tuple[str, int], set[int]] = {}  # (phase, bucket) -> slots holding an adapter then

    def forward(plan):
        before = passes(engine)
        items = plan.batch.items
        phase = {"EXTEND": "prefill", "DECODE": "decode"}.get(plan.host.forward_mode.name, "idle")
        runner = _graph_runner(engine, phase) if phase != "idle" else None
        was = {size for size, b in runner.buckets.items() if b.captured} if runner is not None else set()
        layout = tuple((i.state.request_id, i.state.slot, i.num_tokens, i.state.num_computed,
                        _kind(i.state, i.num_tokens)) for i in items)
        logits = inner(plan)
        after = passes(engine)
        changed = [(k, after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)]
        assert len(changed) == 1 and changed[0][1] == 1, f"one forward counted as {changed}"
        (phase, mode, reason), _ = changed[0]
        bucket, hot = None, 0
        if runner is not None and mode != "eager":
            bucket = runner.choose(plan.host).size
            if bucket not in was:  # captured in this pass: the slots that held an adapter at capture
                captured_slots[(phase, bucket)] = {s for s, a in enumerate(engine.adapters.slots()) if a is not None}
            held_then = captured_slots.get((phase, bucket))
            if held_then is not None:
                hot = sum(1 for i in items if i.state.slot >= 0 and i.state.slot not in held_then)
        steps.append(StepRecord(phase, len(items), plan.host.num_tokens,
                                sum(not i.state.is_decoding for i in items), sum(i.state.is_decoding for i in items),
                                (mode, reason), layout, bucket, hot, bool(engine.runner.check_host_sync)))
        if probe is not None:
            probe.after_step(len(steps) - 1, layout)
        return logits

    engine.runner.forward = forward
    reference: dict[str, str] = {}
    reloads = reloaded = 0
    try:
        requests, arrivals = workload.requests, workload.arrivals
        outputs, step = {}, 0
        pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
        reload = workload.reload if reload_weights is not None else None
        held: list[int] = []
        while pending or held or engine.has_unfinished():
            while pending and arrivals[pending[0]] <= step:
                held.append(pending.pop(0))
            if reload is not None and step >= reload[0] and not engine.adapters.in_use(reload[1]):
                with warnings.catch_warnings():  # its warnings (a no-op adapter) were given at its first load
                    warnings.simplefilter("ignore", AdapterWarning)
                    engine.load_adapter_from_tensors(reload[1], *reload_weights)
                reloads, reload = reloads + 1, None
            keep = []
            for i in held:
                name = requests[i].get("adapter")
                if reload is not None and step >= reload[0] and name == reload[1]:
                    keep.append(i)  # waits for the reload
                    continue
                if reloads and name is not None and name == workload.reload[1]:
                    reference[requests[i]["request_id"]] = RELOADED.format(name)
                    reloaded += 1
                engine.add_request(requests[i])
            held = keep
            for out in engine.step():
                outputs[out.request_id] = out
            step += 1
    finally:
        engine.runner.forward = inner
    m = engine.metrics_
    return Served([outputs[r["request_id"]] for r in requests], steps, passes(engine),
                  int(m.value("moelora_adapter_loads_total")), int(m.value("moelora_adapter_evictions_total")),
                  reference, reloads, reloaded)


def reloaded_weights(adapter_dir) -> tuple[dict, dict]:
    """(tensors, config) of new weights of the adapter at ``adapter_dir`` with its exact config (RL
    weight sync's case): every ``lora_B`` negated and rolled by one along its first axis, ``lora_A`` as is."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return {k: (-t.roll(1, 0) if "lora_B" in k else t) for k, t in tensors.items()}, config


def write_reloaded(adapter_dir, out_dir) -> None:
    """Write :func:`reloaded_weights` of ``adapter_dir`` as a PEFT directory ``out_dir`` (HF + PEFT's reference)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    tensors, config = reloaded_weights(adapter_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
