"""Helpers of the runner's tests: the engine adapters, mixed request sets, the HF + PEFT reference,
a recorder of the engine's steps and snapshots of the pool and KV state.

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
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelora_core import NO_ADAPTER, LogprobCheck, logprob_tolerance

#: The pool rank R of the test engines.
POOL_RANK = 16
#: Where the test engines run (``MOELORA_RUNNER_DEVICE``; the CPU by default).
DEVICE = os.environ.get("MOELORA_RUNNER_DEVICE", "cpu")

#: (suffix, AdapterSpec fields) of the engine adapters.
ENGINE_ADAPTERS: tuple[tuple[str, dict], ...] = (
    ("eng-fused-r8", dict(format="fused", r=8, alpha=16, experts=("gate_up_proj", "down_proj"),
                          dense=("q", "k", "v", "o"))),
    ("eng-rslora-r6", dict(format="fused", r=6, alpha=12, use_rslora=True, experts=("gate_up_proj", "down_proj"),
                           dense=("q", "v"))),
    ("eng-legacy-r3", dict(format="per_expert", r=3, alpha=6, experts=("gate", "up", "down"), dense=("o",))),
    ("eng-attn-r5-fp16", dict(format="fused", r=5, alpha=10, experts=(), dense=("q", "k", "v", "o"),
                              stored_dtype="float16")),
    ("eng-pattern-r4", dict(format="fused", r=4, alpha=8, experts=("gate_up_proj", "down_proj"), dense=("q", "k"),
                            rank_pattern={"gate_up_proj": 2, "q_proj": 7}, alpha_pattern={"down_proj": 5})),
)


#: On a model with a shared expert: the adapters that change, by suffix (see the module docstring).
SHARED_EXPERT_ADAPTERS: dict[str, tuple[str, dict]] = {
    "eng-fused-r8": ("eng-fused-r8", dict(format="fused", r=8, alpha=16, experts=("gate_up_proj", "down_proj"),
                                          dense=("q", "k", "v", "o", "shared_gate", "shared_up", "shared_down"))),
    "eng-legacy-r3": ("eng-shared-r3", dict(format="fused", r=3, alpha=6, experts=(),
                                            dense=("o", "shared_gate", "shared_up", "shared_down"))),
}


def engine_adapter_specs(model: str) -> list[tuple[str, dict]]:
    """(suffix, AdapterSpec fields) of ``model``'s engine adapters."""
    from moelora_conformance.fixtures.specs import model_spec

    if model_spec(model).shared_inter is None:
        return list(ENGINE_ADAPTERS)
    return [SHARED_EXPERT_ADAPTERS.get(suffix, (suffix, fields)) for suffix, fields in ENGINE_ADAPTERS]


def _model_names() -> list[str]:
    from moelora_conformance.fixtures.specs import MODELS

    return [m.name for m in MODELS]


def build_engine_adapters(root: Path) -> None:
    """Build every engine adapter of every fixture model under ``root/<model>/<name>``."""
    from moelora_conformance.fixtures.adapters import build_fused_adapter, build_legacy_adapter
    from moelora_conformance.fixtures.specs import AdapterSpec, model_spec

    for model in _model_names():
        mspec = model_spec(model)
        for suffix, fields in engine_adapter_specs(model):
            name = f"{model}-{suffix}"
            spec = AdapterSpec(name, model, seed=zlib.crc32(name.encode()) % 10_000, **fields)
            build = build_fused_adapter if spec.format == "fused" else build_legacy_adapter
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build(spec, mspec, root / model / name)
    (root / "done").write_text("ok\n")


def engine_adapter_dirs(root: Path) -> dict[str, list[tuple[str, Path]]]:
    return {model: [(f"{model}-{suffix}", root / model / f"{model}-{suffix}")
                    for suffix, _ in engine_adapter_specs(model)] for model in _model_names()}


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
    run are idle steps); the outputs in request order."""
    outputs, step = {}, 0
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            engine.add_request(requests[pending.pop(0)])
        for out in engine.step():
            outputs[out.request_id] = out
        step += 1
    return [outputs[r["request_id"]] for r in requests]


# --- HF + PEFT, run as-is ---------------------------------------------------------------------------


@dataclass
class TeacherForced:
    """HF + PEFT on one sequence: per position p >= 1, the logprob of token p, and per output step the
    reference's argmax and top-2 margin."""

    logprobs: list[float]
    argmax: list[int]
    margins: list[float]


class HFReference:
    """transformers + peft models of one fixture model, one per adapter (peft cannot mix expert adapters
    in one batch), loaded on first use, fp32, eval mode."""

    def __init__(self, model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
        self.model_dir = model_dir
        self.adapter_dirs = adapter_dirs
        self._models: dict[str | None, object] = {}

    def model(self, adapter: str | None):
        if adapter not in self._models:
            from moelora_conformance.hf_check.hf_model import load_hf

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._models[adapter] = load_hf(self.model_dir, None if adapter is None else self.adapter_dirs[adapter])
        return self._models[adapter]

    @torch.no_grad()
    def teacher_forced(self, adapter: str | None, tokens: list[int], prompt_len: int) -> TeacherForced:
        logits = self.model(adapter)(torch.tensor([tokens])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        logprobs = [float(lp[p - 1, tokens[p]]) for p in range(1, len(tokens))]
        steps = range(prompt_len - 1, len(tokens))
        top2 = [torch.topk(lp[p], 2).values for p in steps]
        return TeacherForced(logprobs, [int(lp[p].argmax()) for p in steps], [float(v[0] - v[1]) for v in top2])


def greedy_agreement(tokens: list[int], ref: TeacherForced, tol: float) -> int:
    """Number of output tokens compared: tokens must equal the reference's argmax up to (excluding) the
    first step whose top-2 margin is at most ``2 * tol`` (there a flip is within tolerance; HF's greedy
    continuation of the same prefix would be the same up to that step).

    Raises:
        AssertionError: a token differs where the margin is clear.
    """
    for j, token in enumerate(tokens):
        if ref.margins[j] <= 2 * tol:
            return j
        assert token == ref.argmax[j], (f"output token {j}: engine {token}, HF+PEFT {ref.argmax[j]} "
                                        f"(top-2 margin {ref.margins[j]:.3g})")
    return len(tokens)


def check_against_hf(outputs, requests: list[dict], hf: HFReference, *, dtype: str = "float32") -> dict[str, int]:
    """Every output's prompt and output logprobs within the ``engine_vs_hf`` row (each within max_abs,
    all of them on average within mean_abs) and its greedy tokens equal where the margin allows. Returns {"tokens": output tokens, "compared": tokens compared}."""
    tol = logprob_tolerance("engine_vs_hf", dtype)
    check = LogprobCheck("engine_vs_hf", dtype)
    total = compared = 0
    for req, out in zip(requests, outputs):
        assert out.finish_reason in ("stop", "length"), (req["request_id"], out.error)
        prompt = req["prompt_token_ids"]
        ref = hf.teacher_forced(req.get("adapter"), prompt + out.output_token_ids, len(prompt))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        mine = out.prompt_logprobs[1:] + out.output_logprobs
        check.add(mine, ref.logprobs, what=f"{req['request_id']} ({req.get('adapter') or 'base'}) logprobs")
        if req.get("temperature", 0.0) == 0.0:
            compared += greedy_agreement(out.output_token_ids, ref, tol.max_abs)
            total += len(out.output_token_ids)
    check.finish("engine vs HF+PEFT")
    return {"tokens": total, "compared": compared}


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
    return {r.adapter_id for r in spec.requests if r.adapter_id != NO_ADAPTER}


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
