"""P03: permuting requests permutes outputs; a request's output does not depend on its batch mates.

The drawn batch runs as drawn, with its requests in a drawn order, and as a drawn subset of its
requests (each request carrying its own rows). Every request's rows — MoE output, MoE input and
dense outputs — must match across the three runs within the dtype's tolerance, and each run must
equal the oracle.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import (
    Subject,
    assert_outputs_close,
    draw_capacity,
    draw_case,
    draw_moe_path,
    trace,
)


def _rows_of(batch, order):
    starts = batch.req_seg_indptr
    return [r for q in order for r in range(starts[q], starts[q + 1])]


@conformance("P03")
@given(data=st.data())
def test_permuting_requests_permutes_outputs(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    case = draw_case(data, suite, mode, dtype, kinds=("extend", "decode", "mixed"))
    path = draw_moe_path(data, suite)
    batch = case.batch
    order = data.draw(st.permutations(range(batch.bs)), label="request order")
    keep = data.draw(st.lists(st.booleans(), min_size=batch.bs, max_size=batch.bs), label="requests kept")
    subset = [q for q in range(batch.bs) if keep[q]] or [0]
    trace(f"order: {order}; subset: {subset}")
    capacity = draw_capacity(data, mode, [batch])
    subject = Subject(suite, case, mode, path, capacity)
    inp = subject.inputs()
    full = subject.run_and_check(inp, "as drawn")
    for name, chosen in (("permuted", list(order)), ("subset", subset)):
        part = inp.select(chosen)
        out = subject.run_and_check(part, name)
        index = torch.tensor(_rows_of(batch, chosen), dtype=torch.long, device=full.y.device)
        what = f"{mode} {name} batch vs the drawn batch, per request"
        assert_outputs_close(out, full, subject.ctx, what, rows=index, moe_in=True)
