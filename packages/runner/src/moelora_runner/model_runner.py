"""From a scheduled batch to logits (:class:`ModelRunner`): the step's host lists
(:meth:`ModelRunner.plan`, over :func:`plan_step`), then one forward: eagerly, or by replaying a
captured graph.

:meth:`ModelRunner.forward` takes the :class:`StepPlan` and decides where it runs (DESIGN.md §6):

- a DECODE step on the **decode graph** (:mod:`.graph_runner`, ``mode="decode_graph"``) when it is on;
- an EXTEND step — prefill chunks, and decodes mixed in as 1-token extends — on the **prefill graph**
  (``mode="full"`` or ``"breakable"``) when a prefill mode is on, counted ``phase="prefill"``;
- otherwise, or when the step does not fit (more tokens or requests than the largest bucket, or the
  backend's ``prepare`` answers ``Fallback``), **eagerly**: ``prepare`` once, staging, the model,
  ``mode="eager"`` with the reason (:data:`~.graph_runner.REASONS`).

One backend instance serves every pass (eager and both graph families); a step's lists are staged
once (eagerly into fresh tensors, on a graph into its bucket's views of the family's static batch).

Every pass is counted in ``moelora_forward_passes_total{phase, mode, reason}``; graph passes carry
``reason=""``. The model code is the same in every mode: a graph replays
``MoEDecoder.hidden_states`` (or its segments) on a bucket's static batch, and the LM head runs after
the replay on the step's logits rows.

With ``check_host_sync`` the prepare + staging + forward of every step runs inside
``moelora_core.graphs.host_sync_guard`` — in graph mode the prepare, the static writes, the replay,
the eager attention of ``breakable`` and the LM head — so any host↔device sync there raises
``HostSyncError`` (the tests run every engine so). A capture runs outside it: a host sync during a
capture raises by itself, on CUDA and on the emulator. Reading the logits back to the host happens
after it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moelora_core.batch import BatchSpec, Request
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode
from moelora_core.graphs import graph_pools, host_sync_guard
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.forward_batch import ForwardBatchHost, ForwardBatchStager
from moelora_runner.graph_config import GraphConfig
from moelora_runner.graph_runner import GraphRunner
from moelora_runner.kv_cache import KVCache
from moelora_runner.model import LoRAContext, MoEDecoder
from moelora_runner.scheduler import ScheduledBatch

#: ``phase`` label of a forward mode.
PHASES = {"extend": "prefill", "decode": "decode", "idle": "idle"}


@dataclass(frozen=True)
class RowPlan:
    """Where one request's results are in the step's logits.

    Attributes:
        prompt_rows: (logits row, prompt index i): that row predicts prompt token i (prompt logprobs).
        sample_row: the logits row of the request's next token, or None (mid-prompt chunk, or
            ``max_new_tokens == 0``).
    """

    prompt_rows: tuple[tuple[int, int], ...]
    sample_row: int | None


@dataclass(frozen=True)
class StepPlan:
    """One step: the batch, its host lists and, per item, where its logits rows are."""

    batch: ScheduledBatch
    host: ForwardBatchHost
    rows: tuple[RowPlan, ...]


def plan_step(batch: ScheduledBatch, adapters: AdapterPool) -> StepPlan:
    """The host lists of ``batch`` (tokens laid out request after request, in batch order)."""
    requests, ids, pos, locs, rows, rpi, seq, logits_rows, plans = [], [], [], [], [], [], [], [], []
    offset = 0
    for item in batch.items:
        st, n = item.state, item.num_tokens
        start = st.num_computed
        tokens = st.tokens
        ids += tokens[start:start + n]
        pos += range(start, start + n)
        locs += st.kv.locs[start:start + n]
        rows += [st.kv.row] * n
        rpi.append(st.kv.row)
        seq.append(start + n)
        requests.append(Request(st.slot, n, start))
        prompt_rows = []
        if st.request.prompt_logprobs:
            # Row of position p predicts token p + 1; prompt tokens 1.. get a logprob.
            for p in range(start, min(start + n, len(st.prompt) - 1)):
                prompt_rows.append((offset + p - start, p + 1))
        samples = start + n == st.num_tokens and st.num_generated < st.max_new
        sample_row = offset + n - 1 if samples else None
        wanted = sorted({r for r, _ in prompt_rows} | ({sample_row} if samples else set()))
        index = {r: len(logits_rows) + i for i, r in enumerate(wanted)}
        logits_rows += wanted
        plans.append(RowPlan(tuple((index[r], i) for r, i in prompt_rows),
                             index[sample_row] if samples else None))
        offset += n
    spec = BatchSpec(batch.forward_mode, requests, adapters.max_loras, adapters.slot_ranks(), adapters.slot_scalings())
    host = ForwardBatchHost(spec, tuple(ids), tuple(pos), tuple(locs), tuple(rows), tuple(rpi), tuple(seq),
                            tuple(logits_rows))
    return StepPlan(batch, host, tuple(plans))


#: ``mode`` label of a graph runner (the prefill modes are labelled by their own names).
DECODE_GRAPH_MODE = "decode_graph"


class ModelRunner:
    """One forward of a step, eager or on a graph (see the module doc).

    Args:
        model: the decoder. backend: the LoRA backend of eager passes (one for every layer).
        adapters: the pool. kv: the KV cache. device: the compute device.
        check_host_sync: run prepare + forward under ``host_sync_guard``.
        on_pass: called with (phase, mode, reason) after every forward pass (the metrics).
        graphs: which graphs run (None: none). Every graph bucket of both families uses ``backend``
            too: one backend instance per engine, each family initialised once at its largest bucket.

    Attributes:
        decode_graph, prefill_graph: the :class:`~.graph_runner.GraphRunner` of each family, or None.
        last_fallback: (phase, reason, detail) of the latest eager fallback of a graph-enabled phase.
    """

    def __init__(self, model: MoEDecoder, backend: object, adapters: AdapterPool, kv: KVCache, device: torch.device,
                 *, check_host_sync: bool = False, on_pass=None, graphs: GraphConfig | None = None) -> None:
        self.model = model
        self.backend = backend
        self.adapters = adapters
        self.kv = kv
        self.device = device
        self.check_host_sync = check_host_sync
        self.lora = LoRAContext(backend, adapters.pools)
        self._stager = ForwardBatchStager(device)
        self._on_pass = on_pass or (lambda phase, mode, reason: None)
        self.graphs = graphs or GraphConfig.eager()
        self.decode_graph: GraphRunner | None = None
        self.prefill_graph: GraphRunner | None = None
        self.last_fallback: tuple[str, str, str] | None = None
        if self.graphs.any_graph:
            pools = graph_pools(device)
            common = dict(backend=backend, model=model, kv=kv, adapters=adapters)
            if self.graphs.decode_graph:
                self.decode_graph = GraphRunner("decode", "full", self.graphs.decode_buckets, lambda size: size,
                                                pool=pools["decode"], **common)
            if self.graphs.prefill != "eager":
                self.prefill_graph = GraphRunner("prefill", self.graphs.prefill, self.graphs.prefill_buckets,
                                                 self.graphs.prefill_requests, pool=pools["prefill"], **common)

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """The step of ``batch`` this runner runs next: its host lists and logits rows
        (:func:`plan_step` over this runner's adapter pool), what :meth:`forward` takes."""
        return plan_step(batch, self.adapters)

    def _guard(self):
        return host_sync_guard(self.device) if self.check_host_sync else contextlib.nullcontext()

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every bucket of every graph runner now (start-up capture)."""
        for runner in (self.decode_graph, self.prefill_graph):
            if runner is not None:
                runner.capture_all()

    def _graph_for(self, host: ForwardBatchHost) -> tuple[GraphRunner | None, str]:
        if host.forward_mode is ForwardMode.DECODE:
            return self.decode_graph, DECODE_GRAPH_MODE
        return self.prefill_graph, self.graphs.prefill

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The step's logits rows as fp32 on the host: [len(plan.host.logits_indices), V].

        An IDLE plan launches nothing and returns an empty [0, V] tensor.
        """
        return self.forward_logits(plan).to(device="cpu", dtype=torch.float32)

    @torch.no_grad()
    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """The step's logits rows on the device, in the model dtype (what :meth:`forward` reads back;
        the benchmarks time this): prepare, staging, the forward or replay and the LM head, all
        under the host-sync guard when it is on."""
        host = plan.host
        phase = PHASES[host.forward_mode.value]
        if not host.num_tokens:
            self._on_pass(phase, "eager", "disabled")
            return torch.empty(0, self.model.config.vocab_size, dtype=self.model.dtype, device=self.device)
        runner, mode = self._graph_for(host)
        if runner is None:
            return self._eager(host, phase, "disabled")
        choice = runner.choose(host)
        if choice.size is None:
            return self._fallback(host, phase, choice.reason, choice.detail)
        bucket = runner.bucket(choice.size)  # captured on first use (outside the guard: capture checks itself)
        with self._guard():
            info = bucket.prepare(host.batch_spec)
            if not isinstance(info, Fallback):
                live = bucket.stage(host, info)  # the step's one staging: the bucket's views
                hidden = bucket.replay(live)
                logits = self.model.logits(hidden, live)
        if isinstance(info, Fallback):
            return self._fallback(host, phase, "backend_fallback", info.reason)
        self._on_pass(phase, mode, "")
        return logits

    def _fallback(self, host: ForwardBatchHost, phase: str, reason: str, detail: str) -> torch.Tensor:
        self.last_fallback = (phase, reason, detail)
        return self._eager(host, phase, reason)

    def _eager(self, host: ForwardBatchHost, phase: str, reason: str) -> torch.Tensor:
        with self._guard():
            info = self.backend.prepare(host.batch_spec)
            fb = self._stager.stage(host, info)
            logits = self.model.forward(fb, self.kv, self.lora)
        self._on_pass(phase, "eager", reason)
        return logits
