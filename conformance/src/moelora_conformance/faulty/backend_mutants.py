"""One-line faults in the ``triton`` and ``csgmv`` backends (``moelora_backends``): each class
is one of those backends with one known fault of the field put back, kept in the smallest override
that holds it (the line marked ``FAULT``). The tile mutants rebuild the prefill-graph segmentation
from the real pieces of ``moelora_backends.segmentation`` (``slot_runs``, ``cut_runs``,
``segmentation_of``), with one piece replaced by a faulty line.

They join the mutation registry (:data:`moelora_conformance.faulty.MUTANTS`) when ``moelora_backends``
is installed. Their kernels run under the Triton interpreter on a CPU, far slower than the torch
reference, so each carries an example budget (``max_examples``) the mutation campaign passes to
the suite; the suite must still catch every one (``tests/test_mutations.py``, ``docs/mutations.md``).
"""

from __future__ import annotations

import contextlib
from itertools import groupby
from operator import itemgetter

from moelora_backends import deltas as _deltas
from moelora_backends.csgmv_backend import CsgmvBackend
from moelora_backends.segmentation import PREFILL_TILE, Segmentation, cut_runs, segmentation_of, slot_runs
from moelora_backends.triton_backend import TritonBackend
from moelora_core.batch import BatchSpec
from moelora_core.capabilities import Fallback

#: Examples per property item in the mutation runs of these mutants: the kernel backends' budget in the
#: main job (noxfile.py MAIN_RUN), so the campaign (tests/test_mutations.py) proves that budget catches
#: every one. At 1 the main job's fp32 items miss csgmv-frozen-segment-count (CI=true, 2026-12-06).
KERNEL_MUTANT_BUDGET = 2


class CsgmvFrozenSegmentCount(CsgmvBackend):
    """csgmv decode graph: the chunk count of the batch the graph was captured on stays the launch's
    segment count, so a later batch with more chunks loses the LoRA of its last chunks."""

    name = "mutant-csgmv-frozen-segment-count"
    max_examples = KERNEL_MUTANT_BUDGET

    def prepare(self, batch, family=None, bucket=None):
        info = super().prepare(batch, family, bucket)
        if family == "decode" and not isinstance(info, Fallback):
            if not hasattr(self, "_captured_segments"):
                self._captured_segments = self._families["decode"].segmentation(batch).num_segments
            info.num_segments = self._captured_segments  # FAULT: the live count at capture, not the capacity
        return info


class CsgmvMoEReadsChunks(CsgmvBackend):
    """csgmv: the MoE path reads the dense chunks (adapter-sorted offsets and slots) as if they were
    the requests (sgl-project/sglang#24007)."""

    name = "mutant-csgmv-moe-reads-chunks"
    max_examples = KERNEL_MUTANT_BUDGET
    mapping_fields = ("seg_indptr", "weight_indices")  # FAULT: chunks, not the per-request fields


def _tiles_dropping_the_last_partial(batch: BatchSpec, tile: int = PREFILL_TILE) -> Segmentation:
    runs = slot_runs(zip(batch.req_weight_indices, batch.seq_lens))
    # FAULT: the last partial tile is never cut (cut_runs ranges over range(0, n, tile))
    tiles = [(slot, min(tile, n - start)) for slot, n in runs for start in range(0, n - n % tile, tile)]
    return segmentation_of(tiles)


class TritonTilesDropLastPartial(TritonBackend):
    """triton prefill graph: a run's last tile shorter than 16 tokens is dropped, so its tokens get no
    LoRA (and every run shorter than a tile gets none at all)."""

    name = "mutant-triton-tiles-drop-last-partial"
    max_examples = KERNEL_MUTANT_BUDGET
    prefill_graph_segments = staticmethod(_tiles_dropping_the_last_partial)


def _tiles_merging_runs_wrongly(batch: BatchSpec, tile: int = PREFILL_TILE) -> Segmentation:
    requests = zip(batch.req_weight_indices, batch.seq_lens)
    # FAULT: a run takes its last request's length instead of the sum (slot_runs sums the lengths)
    runs = [(slot, [n for _, n in run][-1]) for slot, run in groupby(requests, key=itemgetter(0))]
    return segmentation_of(cut_runs(runs, tile))


class TritonRunsMergedWrongly(TritonBackend):
    """triton prefill graph: adjacent requests on the same adapter are merged into one run of the
    last request's length, so the run's other tokens get no LoRA and every later tile is shifted
    onto other requests' rows."""

    name = "mutant-triton-runs-merged-wrongly"
    max_examples = KERNEL_MUTANT_BUDGET
    prefill_graph_segments = staticmethod(_tiles_merging_runs_wrongly)


def _host_rank_bound(weights, modules, info):
    # FAULT: the eager rule in graph mode too: the largest rank in the pool now, frozen into the launch
    return max(max(weights.host_ranks[m]) for m in modules)


@contextlib.contextmanager
def _rank_bound_from_host():
    """``moelora_backends.deltas.rank_bound`` replaced by the faulty rule for one delta call."""
    real, _deltas.rank_bound = _deltas.rank_bound, _host_rank_bound
    try:
        yield
    finally:
        _deltas.rank_bound = real


class TritonGraphRankBoundAtCapture(TritonBackend):
    """triton graph families: the kernels' rank bound is the largest rank the pool held at capture (the
    eager rule), not R, so an adapter of a larger rank loaded into a slot after the capture is cut to
    the old bound."""

    name = "mutant-triton-graph-rank-bound-at-capture"
    max_examples = KERNEL_MUTANT_BUDGET

    def moe_gate_up_delta(self, *args, **kwargs):
        with _rank_bound_from_host():
            super().moe_gate_up_delta(*args, **kwargs)

    def moe_down_delta(self, *args, **kwargs):
        with _rank_bound_from_host():
            super().moe_down_delta(*args, **kwargs)

    def dense_delta(self, *args, **kwargs):
        with _rank_bound_from_host():
            super().dense_delta(*args, **kwargs)


#: Mutation name → backend class (merged into ``MUTANTS``).
BACKEND_MUTANTS: dict[str, type] = {
    "csgmv-frozen-segment-count": CsgmvFrozenSegmentCount,
    "csgmv-moe-reads-chunks": CsgmvMoEReadsChunks,
    "triton-tiles-drop-last-partial": TritonTilesDropLastPartial,
    "triton-runs-merged-wrongly": TritonRunsMergedWrongly,
    "triton-graph-rank-bound-at-capture": TritonGraphRankBoundAtCapture,
}
