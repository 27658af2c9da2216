"""Stateful engine properties (e2e property E06, DESIGN.md §9): Hypothesis state machines over engine
histories — add requests, step, load / unload / reload / pin / unpin adapters, force evictions, idle
steps, bursts that move the graph runners between buckets — on one backend, model and adapter set.

Rules (:class:`EngineStateMachine`): ``add_request`` (an adapter or none, prompt length, new tokens,
greedy or seeded sampling); ``add_burst`` (2-40 one-token prompts over every registered adapter and
base: more adapters than the per-batch cap, a prefill past 32 requests, larger decode buckets);
``step`` (1-4 engine steps); ``idle_step`` (nothing to run); ``load`` (an adapter directory under
its name), ``reload`` (new weights under a registered name: another adapter's files with B rescaled,
from in-memory tensors), ``unload``, ``pin``, ``unpin``, ``force_eviction`` (pin + unpin an adapter
that has no slot while every slot is taken), ``refused_load`` (NaN factors, a directory that is not an
adapter, DoRA: the reader refuses each).

Invariants:

- every finished request's tokens and logprobs equal the same request run alone on a fresh eager
  engine with the adapter weights it was admitted with (logprobs within ``batched_vs_alone``; greedy
  tokens up to the alone run's first near-tie, as the tolerance policy says);
- no request is ever served by another adapter's weights: before every forward, each request's
  ``BatchSpec`` slot is its own, the slot holds its adapter at the version it was admitted with, and
  after every rule every occupied slot holds exactly a fresh load of its adapter's current version
  (every layer, every module, ranks and σ, bit for bit) and every free slot is zero;
- every step runs where the engine's graph configuration says (the graph of its phase when it fits
  the buckets and request slots, else eagerly with the reason), read from the metrics;
- the per-batch adapter cap holds in every batch; a refused operation (a reader refusal, a reload or
  unload of an adapter in use, an unload of a pinned one, a pin with no slot to have) raises and
  leaves registry, slots, pins, every pool tensor, KV and queues as they were;
- at the end (teardown) every request has finished, all KV is free, no slot is held, and unloading
  every adapter leaves every slot free and zero.

:func:`run_state_machine` runs the machine on one backend, model and adapter set and returns
:class:`~moelora_conformance.e2e.results.E2EResult` records: by default one (mode ``"mixed"``) whose
examples each draw their engine mode (eager, decode graph, prefill ``full``, prefill ``breakable``;
those the backend declares) — the CI-sized run —, or one per mode asked for. ``engine_class`` plugs
an engine-level faulty variant in (``moelora_conformance.faulty.engine_mutants``). The named
histories of the public fault classes are :mod:`.stateful_histories`; what it compares is
:mod:`.stateful_checks`. The engine is imported only
when a machine runs (the conformance package does not depend on the runner).

Cost (reference backend, the ``qwen3_moe`` fixture, 5 adapters on 3 slots, 20 examples of up to 30
rules): 15-50 s of CPU depending on the draws (a burst of 40 requests is 40 alone runs to compare
with); Triton backends under the interpreter are far slower (run them on a GPU or with few examples).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from moelora_conformance.e2e.results import DTYPE_NAMES, E2EResult, checking
from moelora_conformance.e2e.stateful_checks import (
    AdapterVersions,
    assert_unchanged,
    compare_with_alone,
    expected_pass,
    pass_counts,
    pool_rank,
    slot_tensors,
    snapshot,
    tolerance_row,
)
from moelora_core import NO_ADAPTER, LogprobCheck
from moelora_core.errors import MoeLoraError

#: The e2e property id of the state machine (``moelora_conformance.e2e.properties.STATEFUL``).
STATEFUL = "E06"

#: The mode of a record whose examples each draw their engine mode (``e2e.results.MIXED_MODE``).
MIXED_MODE = "mixed"
#: Engine arguments of each e2e mode.
MODE_ARGS: dict[str, dict[str, Any]] = {
    "eager": dict(graph="eager", decode_graph=False),
    "decode_graph": dict(graph="eager", decode_graph=True),
    "full": dict(graph="full", decode_graph=True),
    "breakable": dict(graph="breakable", decode_graph=True),
}
#: The order a mixed machine draws modes in: Hypothesis favours the first, so the mode that runs the
#: most code (both graph families) comes first, eager last.
MIXED_DRAW_ORDER = ("full", "breakable", "decode_graph", "eager")
#: Running requests at most (rows of the KV table): a burst fits, past the 32-request cap.
MAX_NUM_SEQS = 48
#: Decode buckets: a batch of 1 is padded into 2, batches of 3-8 share one bucket (a smaller batch
#: replays after a larger one in the same bucket), bursts reach the largest.
DECODE_BUCKETS = (2, 8, MAX_NUM_SEQS)
#: Prefill token buckets; the token budget never passes the largest, so every prefill fits one.
PREFILL_BUCKETS = (16, 64)
#: Token budgets drawn: a burst's prefill in one step (64, first: Hypothesis favours the first), and
#: chunked prefill with decodes mixed in (5). Each tuple below lists its most telling value first.
BUDGETS = (64, 5)
#: Burst sizes (one-token prompts): more than 32 requests in one prefill, then each decode bucket's sizes.
BURSTS = (33, 40, 2, 3, 5, 9)
#: KV cache sizes: room for a whole burst, and few enough tokens that requests wait for KV.
KV_TOKENS = (512, 96)
#: Refusals ``refused_load`` provokes (each one a reader refusal).
REFUSALS = ("nan-factor", "not-an-adapter", "dora")
#: Prompt lengths and new tokens of ``add_request``.
MAX_PROMPT, MAX_NEW = 20, 5


@dataclass(frozen=True)
class MachineConfig:
    """What one machine class runs on (fixed for its examples).

    Attributes:
        backend: a backend name or ``module:factory``. model_dir: the checkpoint.
        adapters: (name, directory) of every adapter the machine may register.
        max_loras: the engine's slots (below ``len(adapters)``: slots are evicted and reused).
        max_lora_rank: the pool's R (the adapters' largest rank, rounded up to a power of two).
        device, dtype: the engine's. mode: one of :data:`MODE_ARGS`, or ``"mixed"``: each example
            draws its mode from ``modes``.
        modes: the modes a mixed machine draws from.
        engine_class: ``moelora_runner.Engine`` or a subclass (an engine mutant).
    """

    backend: str
    model_dir: Path
    adapters: tuple[tuple[str, Path], ...]
    max_loras: int
    max_lora_rank: int
    device: str
    dtype: str
    mode: str
    engine_class: type
    modes: tuple[str, ...] = ()


@dataclass
class _Tracked:
    """What the machine knows of one request: the request dict, and the adapter version admitted."""

    request: dict
    version: int | None



# --- the machine -----------------------------------------------------------------------------------


class EngineStateMachine(RuleBasedStateMachine):
    """The E06 machine (module doc). Subclasses made by :func:`machine_class` set ``config``."""

    config: MachineConfig
    stats: dict[str, Any]
    alone: dict[str, Any]

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        self.engine = None
        self.mode = cfg.mode
        self.sources = AdapterVersions(cfg.adapters)
        self.names = [n for n, _ in cfg.adapters]
        self.version: dict[str, int] = {}  # registered name -> its version
        self.tracked: dict[str, _Tracked] = {}
        self.finished = 0
        self.steps = 0
        self.refusals = 0
        from moelora_runner.model_info import ModelInfo

        quant = ModelInfo.read(cfg.model_dir).config.base_quant  # an fp8 base: the w8a8 rows
        self.row = tolerance_row(cfg.dtype, quant)
        self.check = LogprobCheck(self.row, cfg.dtype, base_quant=quant)
        self._fingerprints: dict[tuple[str, int], list] = {}
        self._ids = 0
        self._expected: tuple[str, str, str] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="moelora-e06-")

    # --- engines -------------------------------------------------------------------------------

    def _engine(self, engine_class, **kwargs):
        cfg = self.config
        return engine_class(cfg.model_dir, backend=cfg.backend, dtype=cfg.dtype, device=cfg.device,
                            max_lora_rank=cfg.max_lora_rank, max_num_seqs=MAX_NUM_SEQS, **kwargs)

    @initialize(per_batch=st.integers(1, 8), budget=st.sampled_from(BUDGETS), kv_tokens=st.sampled_from(KV_TOKENS),
                mode=st.sampled_from(MIXED_DRAW_ORDER))
    def start(self, per_batch: int, budget: int, kv_tokens: int, mode: str) -> None:
        cfg = self.config
        if cfg.mode != MIXED_MODE:
            mode = cfg.mode
        elif mode not in cfg.modes:  # a mode the backend does not declare: its first one
            mode = cfg.modes[0]
        self.mode = mode
        # every step of the engine under test under the host-sync guard: a sync only the first step after
        # a slot load (a reload, an eviction) makes is on no other path (the one-slot engines that serve a
        # request alone, as a reference, run unguarded: the guard costs a few times the step)
        self.engine = self._engine(cfg.engine_class, check_host_sync=True, max_loras=cfg.max_loras,
                                   max_loras_per_batch=min(per_batch, cfg.max_loras),
                                   max_num_batched_tokens=budget, kv_cache_tokens=kv_tokens,
                                   prefill_token_buckets=PREFILL_BUCKETS, decode_batch_buckets=DECODE_BUCKETS,
                                   **MODE_ARGS[self.mode])
        self.vocab = self.engine.info.config.vocab_size
        # Every adapter but the last is registered: ``load`` has one to add, evictions start at once.
        for name in self.names[:-1] if len(self.names) > 1 else self.names:
            self.sources.load(self.engine, name, 0)
            self.version[name] = 0
        inner = self.engine.runner.forward

        def forward(plan):  # every forward: its metadata checked before it runs
            self._check_plan(plan)
            return inner(plan)

        self.engine.runner.forward = forward

    # --- what every forward and every rule must keep -------------------------------------------

    def _fingerprint(self, name: str, v: int) -> list:
        """Every slot tensor of a fresh load of (name, version) into a one-slot pool per layer."""
        key = (name, v)
        if key not in self._fingerprints:
            from moelora_core.checkpoint.slot_loader import load_adapter_into_slot
            from moelora_core.weights import LoRAWeights

            pools = [LoRAWeights(replace(p.spec, max_loras=1)) for p in self.engine.adapters.pools]
            load_adapter_into_slot(pools, 0, self.engine.adapters.get(name).weights)
            self._fingerprints[key] = [[t.clone() for _, t in slot_tensors(p, 0)] for p in pools]
        return self._fingerprints[key]

    def _check_plan(self, plan) -> None:
        engine = self.engine
        spec = plan.host.batch_spec
        slots = engine.adapters.slots()
        assert len(spec.requests) == len(plan.batch.items), "BatchSpec requests != the step's requests"
        for item, req in zip(plan.batch.items, spec.requests):
            state, rid = item.state, item.state.request_id
            tracked = self.tracked[rid].version
            if state.adapter is None:
                assert req.slot == NO_ADAPTER, f"base request {rid} served by slot {req.slot}"
                continue
            assert req.slot == state.slot and slots[state.slot] == state.adapter, (
                f"request {rid} of adapter {state.adapter!r} served by slot {req.slot}, which holds "
                f"{slots[req.slot] if 0 <= req.slot < len(slots) else None!r} (its slot: {state.slot})")
            assert self.version.get(state.adapter) == tracked, (
                f"request {rid} admitted with {state.adapter!r} v{tracked} is served with "
                f"v{self.version.get(state.adapter)}")
        adapters = plan.batch.adapters()
        assert len(adapters) <= engine.max_loras_per_batch, (
            f"{len(adapters)} distinct adapters {sorted(adapters)} in one batch > cap {engine.max_loras_per_batch}")
        self._expected = expected_pass(engine.graphs, spec.forward_mode.value, len(spec.requests),
                                       plan.host.num_tokens)

    @invariant()
    def slots_hold_exactly_their_adapters(self) -> None:
        if self.engine is None:
            return
        pool = self.engine.adapters
        for slot, name in enumerate(pool.slots()):
            for li, layer in enumerate(pool.pools):
                tensors = slot_tensors(layer, slot)
                if name is None:
                    bad = [n for n, t in tensors if bool(t.any())]
                    assert not bad, f"free slot {slot} is not zero in layer {li}: {bad}"
                    continue
                want = self._fingerprint(name, self.version[name])[li]
                bad = [n for (n, t), w in zip(tensors, want) if not torch.equal(t, w)]
                assert not bad, (f"slot {slot} holds {name!r} v{self.version[name]} but layer {li}'s {bad} differ from "
                                 "a fresh load of it (a previous adapter's modules left in the slot?)")

    def _refused(self, what: str, call, *errors: type[BaseException]) -> bool:
        """Run ``call``; when it raises one of ``errors``, everything must be as before. True if refused."""
        before = snapshot(self.engine)
        try:
            call()
        except errors:
            assert_unchanged(before, snapshot(self.engine), f"refused {what}")
            self.refusals += 1
            return True
        return False

    # --- requests and steps --------------------------------------------------------------------

    def _request(self, adapter: str | None, prompt: list[int], max_new: int, seed: int, sampled: bool,
                 ignore_eos: bool) -> dict:
        self._ids += 1
        return dict(request_id=f"s{self._ids}", prompt_token_ids=prompt, adapter=adapter, max_new_tokens=max_new,
                    temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0, seed=seed,
                    ignore_eos=ignore_eos, prompt_logprobs=True, logprobs=2)

    def _add(self, request: dict) -> None:
        from moelora_runner.errors import UnknownAdapterError

        name = request["adapter"]
        if name is not None and name not in self.version:
            assert self._refused(f"add_request with unregistered {name!r}",
                                 lambda: self.engine.add_request(request), UnknownAdapterError), \
                f"a request for the unregistered adapter {name!r} was accepted"
            return
        self.engine.add_request(request)
        self.tracked[request["request_id"]] = _Tracked(request, None if name is None else self.version[name])

    @rule(adapter=st.integers(-1, 7), length=st.integers(1, MAX_PROMPT), max_new=st.integers(0, MAX_NEW),
          seed=st.integers(0, 2**31 - 1), sampled=st.booleans(), ignore_eos=st.booleans())
    def add_request(self, adapter, length, max_new, seed, sampled, ignore_eos) -> None:
        name = None if adapter < 0 else self.names[adapter % len(self.names)]
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, self.vocab, (length,), generator=gen).tolist()
        self._add(self._request(name, prompt, max_new, seed, sampled, ignore_eos))

    @rule(n=st.sampled_from(BURSTS), adapters=st.integers(0, 8), offset=st.integers(0, 3),
          seed=st.integers(0, 2**31 - 1))
    def add_burst(self, n, adapters, offset, seed) -> None:
        """n one-token prompts cycling over base and some registered adapters, generating 1-4 tokens
        each. ``adapters`` 0-3: that many adapters, at most the per-batch cap (the cap never holds the
        queue: a prefill step past 32 requests); 4-8: every registered adapter (more adapters than the
        cap and the slots: N adapters + base overflowing the batch). Decode batches then shrink inside
        a bucket as requests finish at different steps."""
        registered = sorted(self.version)
        k = min(adapters, self.engine.max_loras_per_batch) if adapters < 4 else len(registered)
        names = [*registered[:k], None]
        gen = torch.Generator().manual_seed(seed)
        for i in range(n):
            token = int(torch.randint(0, self.vocab, (1,), generator=gen))
            self._add(self._request(names[i % len(names)], [token], 1 + (i + offset) % 4, seed + i, False, True))

    def _alone_output(self, tracked: _Tracked):
        request = tracked.request
        key = json.dumps([request["adapter"], tracked.version, {k: v for k, v in request.items() if k != "request_id"}],
                         sort_keys=True)
        alone = type(self).alone  # shared by the class's examples: the same request alone is the same run
        if key not in alone:
            from moelora_runner import Engine

            engine = self._engine(Engine, max_loras=1, max_num_batched_tokens=64, kv_cache_tokens=256,
                                  **MODE_ARGS["eager"])  # eager on CUDA too (its default captures graphs)
            if request["adapter"] is not None:
                self.sources.load(engine, request["adapter"], tracked.version)
            alone[key] = engine.generate([request])[0]
        return alone[key]

    def _one_step(self) -> None:
        before = pass_counts(self.engine)
        self._expected = None
        outputs = self.engine.step()
        self.steps += 1
        after = pass_counts(self.engine)
        diff = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
        expected = self._expected or ("idle", "eager", "disabled")
        assert diff == {expected: 1.0}, (
            f"step {self.steps} counted {diff}, expected one pass {expected} (graphs {self.engine.graphs}; "
            f"last fallback {self.engine.runner.last_fallback})")
        for out in outputs:
            tracked = self.tracked.pop(out.request_id)
            what = (f"{out.request_id} ({tracked.request['adapter'] or 'base'} v{tracked.version}, "
                    f"mode {self.mode})")
            compare_with_alone(out, self._alone_output(tracked), self.check, tracked.request, what)
            self.finished += 1

    @precondition(lambda self: self.engine is not None and self.engine.has_unfinished())
    @rule(n=st.integers(1, 4))
    def step(self, n) -> None:
        for _ in range(n):
            if not self.engine.has_unfinished():
                break
            self._one_step()

    @precondition(lambda self: self.engine is not None and not self.engine.has_unfinished())
    @rule()
    def idle_step(self) -> None:
        self._one_step()

    # --- adapters ------------------------------------------------------------------------------

    def _in_use_errors(self):
        from moelora_runner.errors import AdapterInUseError, AdapterPinnedError, NoFreeSlotError

        return AdapterInUseError, AdapterPinnedError, NoFreeSlotError

    @precondition(lambda self: self.engine is not None and len(self.version) < len(self.names))
    @rule(i=st.integers(0, 7))
    def load(self, i) -> None:
        missing = [n for n in self.names if n not in self.version]
        name = missing[i % len(missing)]
        self.sources.load(self.engine, name, 0)
        self.version[name] = 0

    @precondition(lambda self: self.engine is not None and self.version)
    @rule(i=st.integers(0, 7))
    def reload(self, i) -> None:
        name = sorted(self.version)[i % len(self.version)]
        v = self.version[name] + 1
        if self._refused(f"reload of {name!r}", lambda: self.sources.load(self.engine, name, v),
                         *self._in_use_errors()):
            assert self.engine.adapters.in_use(name), f"reload of {name!r} refused while not in use"
            return
        assert not self.engine.adapters.in_use(name), f"reload of {name!r} accepted while requests use it"
        self.version[name] = v

    @precondition(lambda self: self.engine is not None and self.version)
    @rule(i=st.integers(0, 7))
    def unload(self, i) -> None:
        name = sorted(self.version)[i % len(self.version)]
        pool = self.engine.adapters
        blocked = pool.in_use(name) or name in pool.pinned()
        refused = self._refused(f"unload of {name!r}", lambda: self.engine.unload_adapter(name),
                                *self._in_use_errors())
        assert refused == blocked, f"unload of {name!r}: refused={refused}, in use or pinned={blocked}"
        if not refused:
            del self.version[name]

    @precondition(lambda self: self.engine is not None and self.version
                  and len(self.engine.adapters.pinned()) < self.config.max_loras - 1)
    @rule(i=st.integers(0, 7))
    def pin(self, i) -> None:
        # At most max_loras - 1 pins, so a request's adapter can always get a slot eventually.
        name = sorted(self.version)[i % len(self.version)]
        self._refused(f"pin of {name!r}", lambda: self.engine.pin(name), *self._in_use_errors())

    @precondition(lambda self: self.engine is not None and self.engine.adapters.pinned())
    @rule(i=st.integers(0, 7))
    def unpin(self, i) -> None:
        pinned = sorted(self.engine.adapters.pinned())
        self.engine.unpin(pinned[i % len(pinned)])

    def _unslotted(self) -> list[str]:
        slots = self.engine.adapters.slots()
        return [n for n in sorted(self.version) if n not in slots] if None not in slots else []

    @precondition(lambda self: self.engine is not None and self._unslotted())
    @rule(i=st.integers(0, 7))
    def force_eviction(self, i) -> None:
        """Every slot is taken and a registered adapter has none: pin it (evicting the least recently
        used slot no running request holds) and unpin it."""
        candidates = self._unslotted()
        name = candidates[i % len(candidates)]
        evictions = self.engine.metrics_.value("moelora_adapter_evictions_total")
        if self._refused(f"eviction for {name!r}", lambda: self.engine.pin(name), *self._in_use_errors()):
            return
        self.engine.unpin(name)
        assert self.engine.metrics_.value("moelora_adapter_evictions_total") == evictions + 1, "no eviction counted"

    @rule(kind=st.sampled_from(REFUSALS), i=st.integers(0, 7))
    def refused_load(self, kind, i) -> None:
        """A load the reader must refuse, under a registered name (a refused reload) or a new one."""
        if self.engine is None:
            return
        name = self.names[i % len(self.names)]
        tensors, config = self.sources.files(name)
        if kind == "not-an-adapter":
            empty = Path(self._tmp.name) / f"empty-{i}"
            empty.mkdir(exist_ok=True)
            call = lambda: self.engine.load_adapter(name, empty)
        else:
            tensors = {k: t.clone() for k, t in tensors.items()}
            if kind == "nan-factor":
                key = next(k for k in sorted(tensors) if ".lora_B." in k)
                tensors[key].view(-1)[0] = float("nan")
            else:
                config = dict(config, use_dora=True)
            call = lambda: self.engine.load_adapter_from_tensors(name, tensors, config)
        assert self._refused(f"{kind} load of {name!r}", call, MoeLoraError), f"{kind} load of {name!r} accepted"

    # --- the end -------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            # Hypothesis calls teardown in a ``finally`` after a failed rule too: the failure stands as it
            # is, and the end-of-run checks would only replace it with a consequence of it.
            if self.engine is None or sys.exc_info()[0] is not None:
                return
            for _ in range(10_000):
                if not self.engine.has_unfinished():
                    break
                self._one_step()
            engine = self.engine
            assert not engine.has_unfinished() and not self.tracked, f"unfinished requests: {sorted(self.tracked)}"
            assert engine.kv.free_tokens == engine.kv.num_tokens, (
                f"KV not freed: {engine.kv.num_tokens - engine.kv.free_tokens} locations still reserved")
            held = [n for n in engine.adapters.names() if engine.adapters.in_use(n)]
            assert not held, f"adapters still held by requests after every request finished: {held}"
            for name in sorted(engine.adapters.pinned()):
                engine.unpin(name)
            for name in list(engine.adapters.names()):
                engine.unload_adapter(name)
            self.version.clear()
            assert engine.adapters.slots() == (None,) * self.config.max_loras, engine.adapters.slots()
            self.slots_hold_exactly_their_adapters()  # every slot free and zero
            self.check.finish(f"E06 requests vs alone ({self.mode})")
            stats = type(self).stats
            stats["examples"] += 1
            stats["steps"] += self.steps
            stats["requests_checked"] += self.finished
            stats["evictions"] += int(engine.metrics_.value("moelora_adapter_evictions_total"))
            stats["refusals"] += self.refusals
            stats["examples_by_mode"][self.mode] = stats["examples_by_mode"].get(self.mode, 0) + 1
        finally:
            self._tmp.cleanup()


def machine_class(config: MachineConfig) -> type[EngineStateMachine]:
    """An :class:`EngineStateMachine` subclass bound to ``config`` (its ``stats`` count what its runs did)."""
    stats = {"examples": 0, "steps": 0, "requests_checked": 0, "evictions": 0, "refusals": 0,
             "examples_by_mode": {}}
    return type(f"EngineStateMachine_{config.mode}", (EngineStateMachine,),
                {"config": config, "stats": stats, "alone": {}})


def supported_modes(backend: str, model_dir: Path, device: str, dtype: str) -> tuple[str, ...]:
    """The e2e modes the backend declares (its capabilities: prefill graph modes, the decode family)."""
    from moelora_core import load_backend
    from moelora_core.checkpoint import MoECheckpoint
    from moelora_runner.engine import DTYPES

    with MoECheckpoint(model_dir) as ckpt:
        spec = ckpt.config.layer_spec(max_loras=1, max_rank=1, dtype=DTYPES[dtype], device=torch.device(device))
    caps = load_backend(backend)(spec).capabilities()
    out = ["eager"]
    if "decode" in caps.graph_families:
        out.append("decode_graph")
        out += [m for m in ("full", "breakable") if m in caps.prefill_graph_modes]
    return tuple(out)


def run_state_machine(*, backend: str, model_dir: str | Path, adapters: Mapping[str, str | Path], max_examples: int,
                      max_loras: int, device: str = "cpu", dtype: str = "float32", engine_class: type | None = None,
                      modes: tuple[str, ...] | None = None, seed: int | None = 0, step_count: int = 30,
                      shrink_seconds: float | None = 30) -> list[E2EResult]:
    """Run the E06 machine on one backend, model and adapter set, once per engine mode.

    Args:
        backend: a backend name or ``module:factory``. model_dir: a Hugging Face MoE checkpoint.
        adapters: name → PEFT adapter directory (at least one; more than ``max_loras`` so slots are
            evicted and reused; every adapter but the last is registered at the start).
        max_examples: Hypothesis examples per mode. max_loras: the engine's slots.
        device, dtype: the engine's ("cpu" / "cuda", "float32" / "float16" / "bfloat16").
        engine_class: ``moelora_runner.Engine`` (default) or a subclass (an engine mutant).
        modes: engine modes to run, one record each; :data:`MIXED_MODE` runs one machine whose examples
            draw their mode among the backend's (default: ``("mixed",)``, the CI-sized run).
        seed: the Hypothesis seed (None: random). step_count: rules per example.
        shrink_seconds: how long a failure may shrink.

    Returns:
        One ``E2EResult`` (property E06) per mode: passed, or failed with the first line of the failure
        and the failing steps in ``details["steps"]``; ``details`` counts examples, steps, requests.

    Raises:
        ValueError: no adapters, ``max_loras`` < 1, an adapter directory without a readable config, or a
            mode the backend does not declare.
    """
    from moelora_conformance.hypothesis_compat import shrink_time_limit, state_machine_test

    if not adapters:
        raise ValueError("the state machine needs at least one adapter (--adapter NAME=DIR)")
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    if engine_class is None:
        from moelora_runner import Engine as engine_class
    model_dir = Path(model_dir)
    paths = {n: Path(p) for n, p in adapters.items()}
    rank = pool_rank(paths)
    declared = supported_modes(backend, model_dir, device, dtype)
    chosen = (MIXED_MODE,) if modes is None else tuple(modes)
    unknown = [m for m in chosen if m not in (*declared, MIXED_MODE)]
    if unknown:
        raise ValueError(f"modes {unknown} are not declared by backend {backend!r} (it runs {list(declared)})")
    results = []
    for mode in chosen:
        config = MachineConfig(backend, model_dir, tuple(paths.items()), max_loras, rank, device, dtype, mode,
                               engine_class, declared)
        result = E2EResult(STATEFUL, backend, mode, DTYPE_NAMES.get(dtype, dtype), model_dir.name)
        cls = machine_class(config)
        quick = settings(max_examples=max_examples, stateful_step_count=step_count, deadline=None, database=None,
                         phases=(Phase.explicit, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
                         report_multiple_bugs=False)
        with checking(result), shrink_time_limit(shrink_seconds):
            try:
                state_machine_test(cls, settings=quick, seed=seed)()
            except BaseException as exc:
                result.details["failing_steps"] = "\n".join(getattr(exc, "__notes__", []))[-6000:]
                raise
        result.details.update(cls.stats, modes=list(declared if mode == MIXED_MODE else (mode,)),
                              max_loras=max_loras, adapters=len(paths), max_lora_rank=rank,
                              host_sync_guard="every step of the engine under test")
        result.repro = _rerun(backend, model_dir, paths, max_examples=max_examples, max_loras=max_loras,
                              mode=mode, seed=seed, step_count=step_count, dtype=dtype, device=device,
                              default_engine=engine_class.__name__ == "Engine"
                              and engine_class.__module__.startswith("moelora_runner"))
        results.append(result)
    return results


def _rerun(backend: str, model_dir: Path, adapters: dict[str, Path], *, max_examples: int, max_loras: int, mode: str,
           seed: int | None, step_count: int, dtype: str, device: str, default_engine: bool) -> str:
    """The rerun line of one E06 record: the ``moelora-conformance e2e --properties E06`` command where the
    run is one the command makes (the engine itself, the mixed mode, seed 0, 30 steps), else the Python call
    (an engine mutant, another mode, seed or step count)."""
    from moelora_conformance.e2e.run import E2EConfig, model_inputs, rerun_line

    if default_engine and mode == MIXED_MODE and seed == 0 and step_count == 30:
        config = E2EConfig(state_machine_examples=max_examples, max_loras=max_loras)
        return rerun_line(backend, model_inputs(model_dir, adapters), config, dtype=dtype, device=device)
    paths = {n: str(p) for n, p in adapters.items()}
    return (f"run_state_machine(backend={backend!r}, model_dir={str(model_dir)!r}, adapters={paths!r}, "
            f"max_examples={max_examples}, max_loras={max_loras}, modes=({mode!r},), seed={seed!r}, "
            f"step_count={step_count}, dtype={dtype!r}, device={device!r})")
