"""Backend faults the engine exposes: each class is a backend (loaded by ``module:factory`` like any
other) with one known fault of the serving trackers put back, which shows only when an engine
captures several graph buckets over one buffer set per family, as production engines do (DESIGN.md
§6). The e2e suite must catch each one (``moelora-conformance mutations --e2e``; the table in
``docs/mutations.md``; ``e2e/test_e2e_workload.py::test_faults_are_caught``).

They are kept apart from the layer mutants (:data:`moelora_conformance.faulty.MUTANTS`), which the
layer suite's campaign runs: the layer-level ``stale-tail`` mutant leaves the tail of one family's
buffers in every prepare; :class:`StaleTailAcrossBuckets` resets every tail a per-bucket buffer set
would need, and only the sharing across buckets leaves a larger batch's entries behind.
"""

from __future__ import annotations

import copy
import dataclasses

from moelora_core.batch import BatchSpec, Request
from moelora_core.sentinels import NO_ADAPTER
from moelora_core.static_buffer import StaticBuffer
from moelora_reference.backend import ReferenceBackend


class _PerBucketTailBuffer(StaticBuffer):
    """A static buffer whose write resets a view's tail only as far as the previous write of a view of
    the same length (the same bucket) reached."""

    def padded(self, values, tail_fill=None, rows=None):
        rows = self.capacity if rows is None else rows
        mirror = self.__dict__.setdefault("_mirror", [self.fill] * self.capacity)  # the buffer, as written
        reached = self.__dict__.setdefault("_reached", {})  # view length -> entries its last write set
        n, fill = len(values), self.fill if tail_fill is None else tail_fill
        # FAULT: past what this bucket's own previous batch wrote, the tail is left as it is (right when each
        # bucket owns its buffers; with one buffer set per family, a larger bucket's batch wrote there).
        full = [*values, *([fill] * max(0, reached.get(rows, 0) - n)), *mirror[max(n, reached.get(rows, 0)):rows]]
        reached[rows] = n
        self._mirror = full + mirror[rows:]
        return full


class StaleTailAcrossBuckets(ReferenceBackend):
    """Graph buckets share one buffer set per family, but each bucket's prepare resets the request
    segments' tail only as far as that bucket's own previous batch reached (enough while every bucket
    owns its buffers): a bucket used after a larger batch of a larger bucket reads that batch's requests
    past its own, and the token map built from them gives live rows another request's adapter."""

    name = "mutant-stale-tail-across-buckets"

    def init_graph(self, family, capacity):
        super().init_graph(family, capacity)
        fam = self._families[family]
        for name in ("req_seg_indptr", "req_weight_indices"):
            old = fam.buffers[name]
            fam.buffers[name] = _PerBucketTailBuffer(old.name, old.capacity, dtype=old.tensor.dtype,
                                                     device=old.tensor.device, fill=old.fill)


class ChunkMetadataMemoised(ReferenceBackend):
    """The prefill graph's metadata is memoised on the request → slot list: a bucket prepared for the same
    slots as the family's previous batch keeps that batch's metadata (its extend lengths), so a chunked
    prefill whose chunk layout changed maps its tokens with the previous layout."""

    name = "mutant-chunk-metadata-memoised"

    def prepare(self, batch, family=None, bucket=None):
        if family != "prefill":
            return super().prepare(batch, family, bucket)
        key = (repr(bucket), tuple(r.slot for r in batch.requests))
        last = self.__dict__.get("_last_prefill")
        if last is not None and last[0] == key:
            return last[1]  # FAULT: keyed on the slots, not the extend lengths
        info = super().prepare(batch, family, bucket)
        self._last_prefill = (key, info)
        return info


class LayerZeroSigma(ReferenceBackend):
    """σ of every layer taken from layer 0's pool (the first pool the backend sees): right for adapters
    whose rank and α are the same in every layer, wrong for a layer-specific ``rank_pattern`` /
    ``alpha_pattern``."""

    name = "mutant-layer-zero-sigma"

    def _layer0(self, weights):
        first = self.__dict__.setdefault("_first_pool", weights)
        view = copy.copy(weights)  # shares every tensor
        view.scalings = first.scalings  # FAULT: layer 0's σ in every layer
        return view

    def moe_gate_up_delta(self, x, topk_ids, gate_up_out, weights, info, **kwargs):
        super().moe_gate_up_delta(x, topk_ids, gate_up_out, self._layer0(weights), info, **kwargs)

    def moe_down_delta(self, h, topk_ids, topk_weights, down_out, weights, info, **kwargs):
        super().moe_down_delta(h, topk_ids, topk_weights, down_out, self._layer0(weights), info, **kwargs)

    def dense_delta(self, module, x, out, weights, info):
        super().dense_delta(module, x, out, self._layer0(weights), info)


class SameConfigReloadKept(ReferenceBackend):
    """The factors are cached per pool and module and refreshed only when that module's ranks or σ
    change (the pool's host copies): a reload of a name with new weights of the same config — RL weight
    sync — keeps serving the old weights."""

    name = "mutant-same-config-reload-kept"

    def _cached(self, weights):
        cache = self.__dict__.setdefault("_factor_cache", {})
        view = copy.copy(weights)
        factors = weights.factors

        def cached_factors(module):
            config = (tuple(weights.host_ranks[module]), tuple(weights.host_scalings[module]))
            hit = cache.get((id(weights), module))
            if hit is None or hit[0] != config:  # FAULT: new weights of the same config are not seen
                hit = cache[id(weights), module] = (config, tuple(t.clone() for t in factors(module)))
            return hit[1]

        view.factors = cached_factors
        return view

    def moe_gate_up_delta(self, x, topk_ids, gate_up_out, weights, info, **kwargs):
        super().moe_gate_up_delta(x, topk_ids, gate_up_out, self._cached(weights), info, **kwargs)

    def moe_down_delta(self, h, topk_ids, topk_weights, down_out, weights, info, **kwargs):
        super().moe_down_delta(h, topk_ids, topk_weights, down_out, self._cached(weights), info, **kwargs)

    def dense_delta(self, module, x, out, weights, info):
        super().dense_delta(module, x, out, self._cached(weights), info)


class HotSlotFrozenAtCapture(ReferenceBackend):
    """Graph buckets keep the slots that held an adapter when they were captured: a request whose
    adapter was loaded later into a slot that was empty at the capture (a hot load) gets no LoRA on
    that bucket."""

    name = "mutant-hot-slot-frozen-at-capture"

    def prepare(self, batch, family=None, bucket=None):
        if family is None:
            return super().prepare(batch, family, bucket)
        held = self.__dict__.setdefault("_held_at_capture", {}).setdefault(
            (family, repr(bucket)), {s for s, r in enumerate(batch.lora_ranks) if r > 0})
        # FAULT: a slot empty at the bucket's capture serves no adapter on it
        slots = [r.slot if r.slot in held else NO_ADAPTER for r in batch.requests]
        requests = [Request(s, r.extend_len, r.prefix_len) for s, r in zip(slots, batch.requests)]
        return super().prepare(BatchSpec(batch.forward_mode, requests, batch.max_loras, batch.lora_ranks,
                                         batch.scalings), family, bucket)


class SyncAfterSlotLoad(ReferenceBackend):
    """The first delta after a slot load reads a device value on the host (``float(σ.sum())``, a check
    that runs once per load): invisible to a host-sync check whose batches never follow a load."""

    name = "mutant-sync-after-slot-load"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), slot_load_hook=True)

    def on_slot_loaded(self, slot, weights):
        self._just_loaded = True

    def dense_delta(self, module, x, out, weights, info):
        if self.__dict__.pop("_just_loaded", False):
            float(weights.scalings(module).sum())  # FAULT: a host read of device data
        super().dense_delta(module, x, out, weights, info)


#: Mutation name → backend class of every fault the e2e suite must catch.
E2E_MUTANTS: dict[str, type] = {
    "stale-tail-across-buckets": StaleTailAcrossBuckets,
    "chunk-metadata-memoised": ChunkMetadataMemoised,
    "layer-zero-sigma": LayerZeroSigma,
    "same-config-reload-kept": SameConfigReloadKept,
    "hot-slot-frozen-at-capture": HotSlotFrozenAtCapture,
    "sync-after-slot-load": SyncAfterSlotLoad,
}
