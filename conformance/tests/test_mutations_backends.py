"""The ``triton`` / ``csgmv`` mutants (``faulty/backend_mutants.py``) hold the fault they name, and are
in the mutation set that ``tests/test_mutations.py`` runs the suite against.

Covers, without running the suite (fast): each mutant is registered with a factory and an example
budget; on a named batch each shows its fault where the clean backend does not — a csgmv decode
graph keeps the capture batch's chunk count, csgmv's MoE token mapping follows the adapter-sorted
chunks, triton's prefill tiles lose a run's last partial tile, and adjacent same-adapter requests
merge into a run of the wrong length, and a triton graph captured on a pool of small ranks cuts an
adapter of a larger rank loaded after the capture. Whether the suite catches each one is
``test_mutant_is_caught_by_a_general_property[<name>]``.
"""

import pytest
import torch

pytest.importorskip("moelora_backends")

from moelora_backends.csgmv_backend import CsgmvBackend
from moelora_backends.triton_backend import TritonBackend
from moelora_conformance.faulty import FACTORIES, MUTANTS
from moelora_conformance.faulty.backend_mutants import BACKEND_MUTANTS
from moelora_core import BatchSpec, ForwardMode, LoRALayerSpec, Request
from moelora_core.backend_checks import GraphCapacity
from moelora_reference.segments import tile_segments

L = 3
POOL = (L, (4, 4, 4), (1.0, 1.0, 1.0))


def _spec():
    return LoRALayerSpec(8, 8, 4, 2, {}, L, 4)


def _extend(*lens_slots):
    return BatchSpec(ForwardMode.EXTEND, [Request(s, n) for n, s in lens_slots], *POOL)


def test_every_backend_mutant_is_registered_with_a_budget():
    for name, cls in BACKEND_MUTANTS.items():
        assert MUTANTS[name] is cls and name in FACTORIES
        assert isinstance(cls.max_examples, int) and cls.max_examples >= 1
        assert "FAULT" not in (cls.__doc__ or "") and cls.__doc__.strip()


@pytest.mark.interpreter
def test_frozen_segment_count_keeps_the_capture_batch_count():
    small = BatchSpec(ForwardMode.DECODE, [Request(0, 1)], *POOL)
    large = BatchSpec(ForwardMode.DECODE, [Request(s, 1) for s in (0, 1, 2, -1, 0, 1)], *POOL)
    counts = {}
    for cls in (CsgmvBackend, BACKEND_MUTANTS["csgmv-frozen-segment-count"]):
        backend = cls(_spec())
        backend.init_graph("decode", GraphCapacity.decode(8, 1))
        counts[cls] = [backend.prepare(b, "decode").num_segments for b in (small, large)]
    clean, mutant = counts.values()
    assert clean[0] == clean[1] and clean[0] >= 4  # the capacity, fixed at capture
    assert mutant == [1, 1]  # the capture batch's single chunk: the larger batch's other chunks are lost


@pytest.mark.interpreter
def test_moe_reads_chunks_maps_tokens_by_the_sorted_chunks():
    batch = _extend((2, 1), (1, 0), (3, 1), (1, -1))
    want = torch.tensor(batch.token_lora_mapping, dtype=torch.int32)
    clean = CsgmvBackend(_spec()).prepare(batch)
    mutant = BACKEND_MUTANTS["csgmv-moe-reads-chunks"](_spec()).prepare(batch)
    assert torch.equal(clean.token_lora_mapping, want)
    assert not torch.equal(mutant.token_lora_mapping, want)


@pytest.mark.parametrize(("name", "batch"), [
    ("triton-tiles-drop-last-partial", _extend((20, 0), (3, -1), (5, 1))),  # 20 = 16 + 4; 5 < one tile
    ("triton-runs-merged-wrongly", _extend((3, 0), (4, 0), (2, 1))),  # requests 0 and 1 form one run of 7
])
def test_tile_mutants_cut_other_tiles_than_the_twin(name, batch):
    want = tile_segments(list(batch.seq_lens), list(batch.req_weight_indices), 16, merge=True)
    clean = TritonBackend.prefill_graph_segments(batch)
    bad = BACKEND_MUTANTS[name].prefill_graph_segments(batch)
    assert tuple(clean.seg_indptr) == want.seg_indptr and tuple(clean.weight_indices) == want.weight_indices
    assert bad.seg_indptr[-1] < batch.num_tokens  # some adapter tokens lie in no tile


@pytest.mark.interpreter
def test_graph_rank_bound_at_capture_cuts_a_larger_adapter_loaded_later():
    from moelora_backends.triton_backend import make_backend as make_triton
    from moelora_conformance.harness import CheckContext, GraphLayer, Layer, Oracle, check_run, derive_inputs
    from moelora_conformance.properties.history import on_pool
    from moelora_conformance.strategies import BatchPlan, LayerShape, MoELoRACase, RoutingPlan, SlotAdapter

    def adapter(rank, sigma):
        return SlotAdapter(rank, sigma * rank, False, tuple((m, rank, sigma * rank) for m in ("gate", "up", "down", "q")))

    shape = LayerShape(hidden_size=16, moe_intermediate_size=16, num_experts=2, num_base_experts=2, top_k=1, dense_shapes=(("q", (16, 8)),), max_loras=2, max_rank=8)
    pool, bigger = (adapter(2, 1.0), adapter(3, 0.5)), adapter(8, 2 / 3)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(0, 3), Request(1, 2)], 2, (2, 3), (1.0, 0.5))
    case = MoELoRACase(shape, torch.float32, False, pool, BatchPlan(batch, "extend", "uniform", "small"),
                       RoutingPlan("uniform", 2, 2, 1, False, None, (), 0.0, 0), 7)
    after = on_pool(batch, (pool[0], bigger))
    outcomes = {}
    for name, factory in (("clean", make_triton), ("mutant", FACTORIES["triton-graph-rank-bound-at-capture"])):
        layer = Layer(factory, case, "cpu")
        graph = GraphLayer(layer, "prefill-full", max_requests=3, max_tokens=8)
        graph.run(layer.inputs())  # captured while the pool's largest rank is 3
        layer.reload(1, bigger, seed=123)
        inp = derive_inputs(case, layer.m, after, seed=5)
        run = graph.run(inp)
        try:
            check_run(Oracle(layer), inp, run, graph.disabled(run), CheckContext(name, 7, torch.float32,
                      torch.device("cpu")), "after the reload", pad_rows=True)
            outcomes[name] = "passed"
        except AssertionError:
            outcomes[name] = "failed"
    assert outcomes == {"clean": "passed", "mutant": "failed"}
