"""Expected values come from the suite's own record of the adapters, and the pool is read-only.

Covers, on named cases with the reference backend and its mutants: the oracle reads the snapshot
of what the suite drew, not the pool (a backend that folds σ into the pool's B in place — right
outputs — fails with ``PoolWritten`` after its first delta call, eagerly and after a graph capture);
a pool that keeps a previous adapter's module in a slot reused by an adapter without it fails the
oracle check (before, the oracle read the same stale pool); the slot-load hook is called for every
loaded slot at the start and after every reload and clear, and a hook that writes the pool fails;
reload draws give a used slot an adapter lacking some of the modules the slot had.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from moelora_conformance.faulty.mutants import FoldsSigmaIntoPool, _load_slot_keeping_absent_modules
from moelora_conformance.harness import CheckContext, GraphLayer, Layer, Oracle, check_run
from moelora_conformance.profiles import PROFILES
from moelora_conformance.properties.history import draw_reload
from moelora_conformance.snapshot import PoolWritten
from moelora_conformance.strategies import BatchPlan, LayerShape, MoELoRACase, RoutingPlan, SlotAdapter
from moelora_conformance.strategies.adapters import pool_ranks, pool_scalings
from moelora_conformance.strategies.suite import suite_cases
from moelora_core import BatchSpec, Capabilities, ForwardMode, LoRAWeights, Request
from moelora_core.layer_spec import MOE_MODULES
from moelora_reference.backend import ReferenceBackend, make_backend

CPU = torch.device("cpu")
DENSE = (("q", (8, 6)), ("o", (6, 8)))
ALL = (*MOE_MODULES, "q", "o")


def _adapter(rank, sigma, modules=ALL):
    return SlotAdapter(rank, sigma * rank, False, tuple((m, rank, sigma * rank) for m in modules))


def _case(pool, requests, seed=7):
    shape = LayerShape(hidden_size=8, moe_intermediate_size=8, num_experts=4, num_base_experts=4, top_k=2, dense_shapes=DENSE, max_loras=len(pool), max_rank=4)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(s, n) for s, n in requests], len(pool), pool_ranks(pool),
                      pool_scalings(pool))
    routing = RoutingPlan("uniform", 4, 4, 2, False, None, (), 0.0, 5)
    return MoELoRACase(shape, torch.float32, False, pool, BatchPlan(batch, "extend", "uniform", "small"), routing,
                       seed)


def _check(layer, inp, run, what="eager"):
    case = layer.case
    check_run(Oracle(layer), inp, run, layer.disabled(inp, run),
              CheckContext(case.describe(), case.seed, case.dtype, CPU), what)


POOL = (_adapter(2, 4 / 3), _adapter(3, 5 / 7))
REQUESTS = ((0, 3), (-1, 2), (1, 4))


def test_the_oracle_reads_the_snapshot_not_the_pool():
    layer = Layer(make_backend, _case(POOL, REQUESTS), CPU)
    view = Oracle(layer).adapters(0)
    assert torch.equal(view.gate_B, layer.weights.gate_B) and torch.equal(view.scalings("up"), layer.weights.scalings("up"))
    with torch.no_grad():
        layer.weights.gate_up_B.mul_(2.0)  # the pool changes behind the suite's back...
    assert not torch.equal(Oracle(layer).adapters(0).gate_B, layer.weights.gate_B)  # ...the oracle does not


def test_a_backend_that_writes_the_pool_fails_though_its_outputs_are_right():
    case = _case(POOL, REQUESTS)
    with pytest.raises(PoolWritten, match=r"after moe_gate_up_delta .*gate_up_B differs"):
        Layer(FoldsSigmaIntoPool, case, CPU).eager(Layer(make_backend, case, CPU).inputs())
    layer = Layer(FoldsSigmaIntoPool, case, CPU)
    graph = GraphLayer(layer, "prefill-full", max_requests=4, max_tokens=12)
    # the emulated capture (no warm-up: GraphPool.default_warmup) restores what it wrote, as a CUDA
    # capture executes nothing, so the write is seen after the first replay
    with pytest.raises(PoolWritten, match=r"after a prefill-full replay: .*gate_up_B differs"):
        graph.run(layer.inputs())


def test_a_pool_keeping_a_previous_adapters_module_in_a_reused_slot_fails(monkeypatch):
    case = _case(POOL, REQUESTS)
    monkeypatch.setattr(LoRAWeights, "load_slot", _load_slot_keeping_absent_modules)
    layer = Layer(make_backend, case, CPU)
    layer.reload(0, _adapter(2, 6 / 5, modules=("gate", "up", "q")), seed=11)  # slot 0 lost down and o
    assert layer.weights.host_ranks["down"][0] == 2  # the faulty pool kept the old adapter's down
    inp = layer.inputs()
    inp = dataclasses.replace(inp, batch=BatchSpec(inp.batch.forward_mode, inp.batch.requests, 2,
                                                   layer.weights.slot_ranks(), layer.weights.slot_scalings()))
    with pytest.raises(AssertionError, match="MoE"):
        _check(layer, inp, layer.eager(inp))
    monkeypatch.undo()
    healthy = Layer(make_backend, case, CPU)
    healthy.reload(0, _adapter(2, 6 / 5, modules=("gate", "up", "q")), seed=11)
    assert healthy.weights.host_ranks["down"][0] == 0
    _check(healthy, inp, healthy.eager(inp))


class _Hooked(ReferenceBackend):
    """The reference with a slot-load hook that records its calls (and, with ``write``, writes the pool)."""

    write = False

    def __init__(self, spec):
        super().__init__(spec)
        self.calls = []

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), slot_load_hook=True)

    def on_slot_loaded(self, slot, weights):
        self.calls.append((slot, id(weights)))
        if self.write:
            weights.down_B[slot].zero_()


def test_the_slot_load_hook_runs_for_every_load_and_may_not_write_the_pool():
    case = dataclasses.replace(_case(POOL, REQUESTS), moe_layers=2)
    layer = Layer(_Hooked, case, CPU)
    pools = [id(p) for _, p in layer.moe_layers]
    assert sorted(layer.backend.calls) == sorted((s, p) for s in (0, 1) for p in pools)
    layer.backend.calls.clear()
    layer.reload(1, None, seed=3)  # clear_slot is a load too
    layer.reload(0, _adapter(1, 2.0), seed=4)
    assert layer.backend.calls == [(1, pools[0]), (1, pools[1]), (0, pools[0]), (0, pools[1])]
    _Hooked.write = True
    try:
        with pytest.raises(PoolWritten, match=r"after on_slot_loaded\(0\)"):
            Layer(_Hooked, case, CPU)
    finally:
        _Hooked.write = False
    assert Capabilities(dtypes=frozenset({torch.float32})).slot_load_hook is False


def test_reloads_give_a_used_slot_an_adapter_lacking_modules_it_had():
    caps = PROFILES["interpret"].caps
    seen = {"reloads": 0, "fewer": 0}

    @settings(max_examples=80, phases=[Phase.generate], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def draw(data):
        case = data.draw(suite_cases(caps, "eager", torch.float32, virtual_experts=False), label="case")
        live = [s for s, a in enumerate(case.pool) if a is not None and len(a.modules) > 1]
        if not live:
            return
        reload = draw_reload(data, case, case.pool, live, seed=1, label="reload")
        if reload.adapter is None or reload.same_config:  # a clear, or the slot's own config again
            return
        seen["reloads"] += 1
        old = {m for m, _, _ in case.pool[reload.slot].modules}
        new = {m for m, _, _ in reload.adapter.modules}
        seen["fewer"] += new < old

    draw()
    assert seen["fewer"] >= 0.25 * seen["reloads"] > 0, seen
