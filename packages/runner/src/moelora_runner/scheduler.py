"""Continuous batching: which requests run in the next step, and how many tokens each computes.

Every step, under a token budget (``max_num_batched_tokens``):

1. **running requests first**, least recently scheduled first (so none waits more than a few steps
   when the budget is smaller than the running set): a decoding request takes 1 token, a request
   still in its prompt takes the next chunk ``min(prompt left, budget left)`` — chunked prefill, so
   prefill chunks and decodes share one batch;
2. **then waiting requests, strictly first come first served**: the head of the queue is admitted
   when (a) its adapter is already used by a running request or fewer than ``max_loras_per_batch``
   distinct adapters are running (base requests never count), (b) its whole KV reservation fits,
   and (c) its adapter gets a slot (``AdapterPool.acquire``: on demand, evicting the least recently
   used adapter that no running request holds). Otherwise admission stops for this step, so no
   later request overtakes it: no starvation. A request whose adapter can never get a slot (every
   slot pinned by other adapters) fails with ``NoFreeSlotError`` instead of waiting forever.

Because the distinct adapters of all running requests are capped, every batch — a subset of the
running requests — respects the cap, and more adapters than slots simply wait their turn. A step
with nothing to run is an empty batch (IDLE): valid, and the engine launches nothing for it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.errors import NoFreeSlotError
from moelora_runner.kv_cache import KVCache
from moelora_runner.sequence import RequestState


@dataclass(frozen=True)
class ScheduledItem:
    """One request of a step and the tokens it computes (``state.tokens[num_computed:][:num_tokens]``)."""

    state: RequestState
    num_tokens: int


@dataclass
class ScheduledBatch:
    """A step's batch: the items in batch order, plus requests that failed at admission."""

    items: list[ScheduledItem] = field(default_factory=list)
    failed: list[tuple[RequestState, Exception]] = field(default_factory=list)

    @property
    def forward_mode(self) -> ForwardMode:
        """IDLE without items; DECODE when every request is past its prompt; else EXTEND (mixed)."""
        if not self.items:
            return ForwardMode.IDLE
        return ForwardMode.DECODE if all(i.state.is_decoding for i in self.items) else ForwardMode.EXTEND

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def adapters(self) -> set[str]:
        """Distinct adapters of the batch (base requests excluded)."""
        return {i.state.adapter for i in self.items if i.state.adapter is not None}


class Scheduler:
    """FCFS continuous batching with chunked prefill (see the module doc).

    Args:
        kv: the KV cache (admission reserves there).
        adapters: the adapter pool (admission acquires slots there).
        max_num_batched_tokens: the per-step token budget (>= 1).
        max_loras_per_batch: distinct adapters allowed among running requests (<= the pool's slots).
        max_running: requests running at once (<= the KV table's rows).
        max_batch_requests: requests per step (a backend's ``max_requests``), or None.
    """

    def __init__(self, kv: KVCache, adapters: AdapterPool, *, max_num_batched_tokens: int, max_loras_per_batch: int,
                 max_running: int, max_batch_requests: int | None = None) -> None:
        self.kv = kv
        self.adapters = adapters
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras_per_batch = max_loras_per_batch
        self.max_running = min(max_running, kv.max_requests)
        self.max_batch_requests = max_batch_requests
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._last_step: dict[str, int] = {}
        self._admitted = itertools.count()
        self._order: dict[str, int] = {}
        self._step = 0

    def add(self, state: RequestState) -> None:
        """Queue a validated request (its adapter counts as in use from now on)."""
        if state.adapter is not None:
            self.adapters.add_waiting(state.adapter)
        self.waiting.append(state)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _room(self, items: list[ScheduledItem]) -> bool:
        return self.max_batch_requests is None or len(items) < self.max_batch_requests

    def schedule(self) -> ScheduledBatch:
        """The next step's batch (see the module doc); admits waiting requests as it goes."""
        self._step += 1
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        order = sorted(self.running, key=lambda s: (self._last_step.get(s.request_id, 0),
                                                    self._order[s.request_id]))
        for state in order:
            if budget == 0 or not self._room(batch.items):
                break
            n = min(state.remaining, budget)
            batch.items.append(ScheduledItem(state, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self._room(batch.items):
            head = self.waiting[0]
            name = head.adapter
            if name is not None and not self.adapters.can_ever_acquire(name):
                self.waiting.popleft()
                self.adapters.remove_waiting(name)
                batch.failed.append((head, NoFreeSlotError(
                    f"adapter {name!r} can never get a slot: all {self.adapters.max_loras} slots are pinned by "
                    f"other adapters ({sorted(self.adapters.pinned())}); unpin one")))
                continue
            if name is not None:
                running = {s.adapter for s in self.running if s.adapter is not None}
                if name not in running and len(running) >= self.max_loras_per_batch:
                    break
            if not self.kv.can_allocate(head.reserve):
                break
            slot = NO_ADAPTER if name is None else self.adapters.acquire(name)
            if slot is None:
                break
            self.waiting.popleft()
            if name is not None:
                self.adapters.remove_waiting(name)
            head.kv = self.kv.allocate(head.reserve)
            head.slot = slot
            self._order[head.request_id] = next(self._admitted)
            self.running.append(head)
            n = min(head.remaining, budget)
            batch.items.append(ScheduledItem(head, n))
            budget -= n
        for item in batch.items:
            self._last_step[item.state.request_id] = self._step
            if item.state.slot != NO_ADAPTER:
                self.adapters.touch(item.state.slot)
        return batch

    def finish(self, state: RequestState) -> None:
        """A running request is done: free its KV and its adapter slot."""
        self.running.remove(state)
        self.kv.free(state.kv)
        state.kv = None
        if state.adapter is not None:
            self.adapters.release(state.adapter)
        self._last_step.pop(state.request_id, None)
        self._order.pop(state.request_id, None)
