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


#: Mutation name → backend class of every fault the e2e suite must catch.
E2E_MUTANTS: dict[str, type] = {
    "stale-tail-across-buckets": StaleTailAcrossBuckets,
}
