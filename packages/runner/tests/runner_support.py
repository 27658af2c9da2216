"""Helpers of the runner's tests: the engine adapters, mixed request sets, the HF + PEFT reference
(both from ``moelora_conformance.e2e``), a recorder of the engine's steps and snapshots of the pool and
KV state.

Engine adapters (per fixture model, built with the fixtures builder on the model's own spec, so every
family gets each format): fused experts + q/k/v/o (r 8), fused + q/v under rsLoRA (r 6), legacy
per-expert gate/up/down + o (r 3), attention-only stored in fp16 (r 5), fused with rank_pattern /
alpha_pattern (r 4; gate_up 2, q 7). Five ranks, five formats. On a model with a shared expert
(Qwen2-MoE) the fused r 8 adapter also targets the shared expert's gate / up / down, and the legacy
one — which peft 0.21.2 does not convert for ``qwen2_moe``, so no HF + PEFT forward exists
(``moelora_conformance.checkpoint_pass.adapters``) — is replaced by a shared-expert + o adapter (r 3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

# The engine adapters and the HF + PEFT reference are the e2e suite's too (one place for each).
from moelora_conformance.e2e.adapters import (  # noqa: F401 (re-exported for the tests)
    ENGINE_ADAPTERS,
    SHARED_EXPERT_ADAPTERS,
    build_engine_adapters,
    engine_adapter_dirs,
    engine_adapter_specs,
)
from moelora_conformance.e2e.engine_checks import (  # noqa: F401 (re-exported for the tests)
    HFReference,
    TeacherForced,
    check_against_hf,
    greedy_agreement,
)
from moelora_core import NO_ADAPTER

#: The pool rank R of the test engines.
POOL_RANK = 16
#: Where the test engines run (``MOELORA_RUNNER_DEVICE``; the CPU by default).
DEVICE = os.environ.get("MOELORA_RUNNER_DEVICE", "cpu")

def mixed_requests(adapters: list[str | None], n: int, *, seed: int, prompt_len: tuple[int, int] = (1, 24),
                   max_new_tokens: int = 6, vocab: int = 96, **fields) -> list[dict]:
    """``n`` request dicts cycling through ``adapters`` (None = base), random prompts of lengths in
    ``prompt_len`` (inclusive) from a generator seeded by ``seed``; ``fields`` apply to all."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=gen))
        ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        out.append(dict(request_id=f"r{i}", prompt_token_ids=ids, adapter=adapters[i % len(adapters)],
                        max_new_tokens=max_new_tokens, prompt_logprobs=True, **fields))
    return out


def run_with_arrivals(engine, requests: list[dict], arrivals: list[int]) -> list:
    """Serve ``requests`` on ``engine``, request i added at step ``arrivals[i]`` (steps with nothing to
    run are idle steps); the outputs in request order (``moelora_conformance.e2e.workload.serve``)."""
    from moelora_conformance.e2e.workload import Workload, serve

    return serve(engine, Workload(tuple(requests), tuple(arrivals), seed=-1)).outputs


# --- the engine's steps and state ---------------------------------------------------------------------


@dataclass
class StepRecord:
    """One forward of the engine: its BatchSpec, the adapters and requests in it."""

    batch_spec: object
    adapters: frozenset[str]
    request_ids: tuple[str, ...]
    prefill_items: int
    decode_items: int
    chunked: int  # requests whose chunk ended before their prompt did


@dataclass
class StepRecorder:
    """Records every forward of ``engine`` (wraps ``engine.runner.forward``)."""

    engine: object
    steps: list[StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = self.engine.runner.forward

        def forward(plan):
            items = plan.batch.items
            self.steps.append(StepRecord(
                plan.host.batch_spec, frozenset(plan.batch.adapters()), tuple(i.state.request_id for i in items),
                sum(not i.state.is_decoding for i in items), sum(i.state.is_decoding for i in items),
                sum(i.state.num_computed + i.num_tokens < len(i.state.prompt) for i in items)))
            return inner(plan)

        self.engine.runner.forward = forward

    def max_distinct_adapters(self) -> int:
        return max((len(s.adapters) for s in self.steps), default=0)

    def mixed_steps(self) -> int:
        """Steps with both a prefill chunk and a decode."""
        return sum(1 for s in self.steps if s.prefill_items and s.decode_items)


def pool_snapshot(engine) -> dict:
    """Everything a refused operation must leave unchanged: registry, slots, pins, every pool tensor,
    the KV bookkeeping and the queues."""
    pools = engine.adapters.pools
    tensors = {}
    for li, p in enumerate(pools):
        for name in ("gate_up_A", "gate_up_B", "down_A", "down_B", "module_ranks", "module_scalings"):
            tensors[f"{li}.{name}"] = getattr(p, name).clone()
        for m in p.dense_A:
            tensors[f"{li}.dense_A.{m}"] = p.dense_A[m].clone()
            tensors[f"{li}.dense_B.{m}"] = p.dense_B[m].clone()
    registry = {n: id(engine.adapters.get(n).weights) for n in engine.adapters.names()}
    return {"registry": registry, "slots": engine.adapters.slots(), "pinned": engine.adapters.pinned(),
            "tensors": tensors, "host_ranks": [dict((m, list(v)) for m, v in p.host_ranks.items()) for p in pools],
            "kv_free": engine.kv.free_tokens, "kv_rows": engine.kv.free_rows,
            "waiting": len(engine.scheduler.waiting), "running": len(engine.scheduler.running)}


def assert_snapshot_equal(before: dict, after: dict) -> None:
    for key in ("registry", "slots", "pinned", "host_ranks", "kv_free", "kv_rows", "waiting", "running"):
        assert before[key] == after[key], f"{key} changed: {before[key]} -> {after[key]}"
    for name, t in before["tensors"].items():
        assert torch.equal(t, after["tensors"][name]), f"pool tensor {name} changed"


def slots_used(spec) -> set[int]:
    return {r.slot for r in spec.requests if r.slot != NO_ADAPTER}


# --- a third-party backend, loaded by "module:factory" ------------------------------------------------

#: Calls of the slot-load hook of every :func:`make_hooked_backend` backend: (backend id, slot, pool id).
HOOK_CALLS: list[tuple[int, int, int]] = []


def make_hooked_backend(spec):
    """The reference backend with the optional slot-load hook declared: records every
    ``on_slot_loaded(slot, weights)`` call (the engine must announce each load, reload and clear to it,
    once per layer pool)."""
    from dataclasses import replace

    from moelora_reference.backend import ReferenceBackend

    class HookedBackend(ReferenceBackend):
        name = "hooked-reference"

        def capabilities(self):
            return replace(super().capabilities(), slot_load_hook=True)

        def on_slot_loaded(self, slot, weights):
            HOOK_CALLS.append((id(self), slot, id(weights)))

    return HookedBackend(spec)
