"""P02: base rows are bit-identical to a LoRA-disabled run, whatever the batch mates and history.

The checked batch mixes base requests with adapter requests (uniform, alternating) or is all base;
before it the same backend ran a drawn history (adapter batches, all-base, IDLE, larger batches,
the other graph family, adapters reloaded into or cleared from used slots — after the graph's
capture in graph modes). Every row of a token without an adapter — MoE and dense outputs — must
equal, bit for bit, the same path with LoRA disabled (no backend call on the ``deltas`` path;
all-base metadata for ``moe_forward``), on the same kernels and shapes; in graph modes every pad
row past the live tokens too.
"""

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.history import HistoryRunner, draw_history, draw_history_capacity
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_case, draw_moe_path, trace


@conformance("P02")
@given(data=st.data())
def test_base_rows_bit_identical_to_lora_disabled(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    case = draw_case(data, suite, mode, dtype, adapter_modes=("uniform", "alternating", "all_base"))
    path = draw_moe_path(data, suite)
    m = case.materialize(suite.device)
    history = draw_history(data, suite, case, m, mode, case.batch)
    case = history.case  # the pool as the history's reloads left it
    capacity = draw_history_capacity(data, mode, case.batch, history.steps)
    subject = Subject(suite, case, mode, path, capacity, materialized=m)
    HistoryRunner(subject, history.steps).run()
    inp = subject.inputs()
    trace(f"checked batch: {inp.describe()}")
    run = subject.run(inp)
    subject.check(inp, run, "after its history", outputs=False, deltas=False)
