"""P08: no host synchronisation in prepare + forward.

Eager: ``prepare`` and every backend call of the forward run under the graph API's host-sync guard
(``moelora_core.graphs.host_sync_guard``: CUDA's sync debug mode "error"; on a CPU the emulator's
rules — no ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` of device data, no data-dependent
shape, no blocking host-to-device copy). Graph modes: ``prepare(batch, family)`` runs under the
guard for two batches, and the layer is captured (a capture fails on any host sync) and replayed.
Outputs still equal the oracle.
"""

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import derive_inputs
from moelora_conformance.properties.history import draw_batch
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, draw_moe_path, trace
from moelora_core.graphs import host_sync_guard


@conformance("P08")
@given(data=st.data())
def test_no_host_sync_in_prepare_and_forward(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    case = draw_case(data, suite, mode, dtype)
    path = draw_moe_path(data, suite)
    guard = lambda: host_sync_guard(suite.device)
    if mode == "eager":
        subject = Subject(suite, case, mode, path)
        inp = subject.inputs()
        trace(f"guarded eager batch: {inp.describe()}")
        run = subject.layer.eager(inp, guard=guard)
        subject.check(inp, run, "guarded eager run")
        return
    second = draw_batch(data, suite, case.batch, mode, label="second batch")
    capacity = draw_capacity(data, mode, [case.batch, second])
    subject = Subject(suite, case, mode, path, capacity)
    for i, inp in enumerate((subject.inputs(), derive_inputs(case, subject.m, second, seed=case.seed + 3))):
        trace(f"batch {i}: {inp.describe()}")
        with guard():
            subject.graph.prepare(inp)
        subject.run_and_check(inp, f"batch {i} (prepared under the guard, captured and replayed)")
