"""P10: virtual experts equal the standard path where declared.

The same case (values, batch, sentinel-rich routing) runs on two backends from the factory: one
built with ``virtual_experts=True`` ((slot, expert) → expert ``slot·E + expert`` of an
``L·E``-expert MoE, sentinels preserved) and one without. Outputs (MoE and dense) match within the
dtype's tolerance, and the virtual run equals the oracle with its deltas and base rows.
"""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import (
    Subject,
    assert_outputs_close,
    draw_capacity,
    draw_case,
    draw_moe_path,
    draw_routing,
)


@conformance("P10")
@given(data=st.data())
def test_virtual_experts_equal_the_standard_path(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    drawn = draw_case(data, suite, mode, dtype, virtual_experts=True)
    case = draw_routing(data, drawn, (0.0, 0.3, 0.6), label="routing")
    path = draw_moe_path(data, suite)
    capacity = draw_capacity(data, mode, [case.batch])
    virtual = Subject(suite, case, mode, path, capacity)
    inp = virtual.inputs()
    run = virtual.run_and_check(inp, "virtual experts")
    m = virtual.m
    standard_m = replace(m, spec=replace(m.spec, virtual_experts=False))
    standard = Subject(suite, replace(case, virtual_experts=False), mode, path, capacity, materialized=standard_m)
    ref = standard.run(inp)
    assert_outputs_close(run, ref, virtual.ctx, f"{mode} virtual experts vs the standard path")
