"""P10: virtual experts equal the standard path where declared.

The same case (values, batch, sentinel-rich routing) runs on two backends from the factory: one
built with ``virtual_experts=True`` ((slot, expert) → expert ``slot·E + expert`` of an
``L·E``-expert MoE, sentinels preserved) and one without. Outputs (MoE and dense) match within the
dtype's tolerance, and the virtual run equals the oracle with its deltas and base rows.
"""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import assert_close
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, draw_moe_path, trace
from moelora_conformance.strategies.routing import routing_plans


@conformance("P10")
@given(data=st.data())
def test_virtual_experts_equal_the_standard_path(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    drawn = draw_case(data, suite, mode, dtype, virtual_experts=True)
    shape = drawn.shape
    routing = data.draw(routing_plans(shape.num_experts, shape.top_k, shape.num_base_experts,
                                      sentinel_shares=(0.0, 0.3, 0.6), seed=drawn.seed), label="routing")
    case = replace(drawn, routing=routing)
    trace(f"routing: {routing.describe()}")
    path = draw_moe_path(data, suite)
    capacity = draw_capacity(data, mode, [case.batch]) if mode != "eager" else None
    virtual = Subject(suite, case, mode, path, capacity)
    inp = virtual.inputs()
    run = virtual.run_and_check(inp, "virtual experts")
    m = virtual.m
    standard_m = replace(m, spec=replace(m.spec, virtual_experts=False))
    standard = Subject(suite, replace(case, virtual_experts=False), mode, path, capacity, materialized=standard_m)
    ref = standard.run(inp)
    what = f"{mode} virtual experts vs the standard path"
    assert_close(run.y, ref.y.double(), virtual.ctx, f"{what}: MoE output")
    for mod, t in run.dense.items():
        assert_close(t, ref.dense[mod].double(), virtual.ctx, f"{what}: dense {mod}")
