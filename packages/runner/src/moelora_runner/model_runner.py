"""From a scheduled batch to logits: the step's host lists (:func:`plan_step`), then one forward
(:class:`ModelRunner`): ``backend.prepare`` once, staging, the model, the logits rows.

This is the eager runner. The graph runners (DESIGN.md §6) slot in behind :meth:`ModelRunner.forward`:
they take the same :class:`StepPlan`, write its lists into their static buffers instead of fresh
tensors, call ``prepare(batch, family=...)`` and replay; the model code is the same. Every pass
is counted in ``moelora_forward_passes_total{phase, mode, reason}``; here mode is "eager" and
reason "disabled" (no graph runner is configured).

With ``check_host_sync`` the prepare + staging + forward of every step runs inside
``moelora_core.graphs.host_sync_guard``: any host↔device sync there raises ``HostSyncError``
(the tests run every engine so). Reading the logits back to the host happens after it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moelora_core.batch import BatchSpec, Request
from moelora_core.graphs import host_sync_guard
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.forward_batch import ForwardBatchHost, ForwardBatchStager
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


class ModelRunner:
    """The eager forward of a step (see the module doc).

    Args:
        model: the decoder. backend: the LoRA backend (one for every layer). adapters: the pool.
        kv: the KV cache. device: the compute device.
        check_host_sync: run prepare + forward under ``host_sync_guard``.
        on_pass: called with (phase, mode, reason) after every forward pass (the metrics).
    """

    mode = "eager"
    reason = "disabled"

    def __init__(self, model: MoEDecoder, backend: object, adapters: AdapterPool, kv: KVCache, device: torch.device,
                 *, check_host_sync: bool = False, on_pass=None) -> None:
        self.model = model
        self.backend = backend
        self.adapters = adapters
        self.kv = kv
        self.device = device
        self.check_host_sync = check_host_sync
        self.lora = LoRAContext(backend, adapters.pools)
        self._stager = ForwardBatchStager(device)
        self._on_pass = on_pass or (lambda phase, mode, reason: None)

    def _guard(self):
        return host_sync_guard(self.device) if self.check_host_sync else contextlib.nullcontext()

    @torch.no_grad()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The step's logits rows as fp32 on the host: [len(plan.host.logits_indices), V].

        An IDLE plan launches nothing and returns an empty [0, V] tensor.
        """
        host = plan.host
        phase = PHASES[host.forward_mode.value]
        vocab = self.model.config.vocab_size
        if not host.num_tokens:
            self._on_pass(phase, self.mode, self.reason)
            return torch.empty(0, vocab, dtype=torch.float32)
        with self._guard():
            info = self.backend.prepare(host.batch_spec)
            fb = self._stager.stage(host, info)
            logits = self.model.forward(fb, self.kv, self.lora)
        self._on_pass(phase, self.mode, self.reason)
        return logits.to(device="cpu", dtype=torch.float32)
