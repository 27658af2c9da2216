"""P04: history independence — a batch after a random prefix of batches (adapter batches, all-base,
IDLE, larger, the other graph family) and adapter reloads (another adapter — fresh values, often a
larger rank, another σ — or new weights of the same config loaded into a slot the batch uses, or the
slot cleared, between batches and, in graph modes, after the capture; a hot load into a slot that was
empty at the capture) equals the same batch on a fresh backend; in graph modes the
other family may also run between the batch's ``prepare`` and its replay.

Half the cases raise the pool's R past every rank its adapters hold (as a server's max LoRA rank),
so a reload can load a larger rank than any the pool held at capture. The fresh backend is built
from the same factory on the same weights — the pool as the reloads left it — and runs the batch in
the same mode with the same capacities. Outputs (MoE, MoE input, dense) match within the dtype's
tolerance, base rows bit for bit, and the run after the history equals the oracle of the reloaded
pool: a backend that caches factors, σ or a rank bound from before a reload fails here.
"""

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import assert_bitwise
from moelora_conformance.harness.checks import base_row_mask
from moelora_conformance.properties.history import (
    HistoryRunner,
    draw_history,
    draw_history_capacity,
    draw_rank_headroom,
    other_family_mode,
)
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, assert_outputs_close, draw_case, draw_moe_path


@conformance("P04")
@given(data=st.data())
def test_batch_after_any_history_equals_a_fresh_backend(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    case = draw_rank_headroom(data, suite, draw_case(data, suite, mode, dtype))
    path = draw_moe_path(data, suite)
    m = case.materialize(suite.device)
    interleave = mode != "eager" and other_family_mode(suite, mode) is not None and data.draw(
        st.booleans(), label="other family between prepare and replay")
    history = draw_history(data, suite, case, m, mode, case.batch, interleave=interleave)
    case = history.case  # the pool as the history's reloads left it
    capacity = draw_history_capacity(data, mode, case.batch, history.steps)
    subject = Subject(suite, case, mode, path, capacity, materialized=m)
    runner = HistoryRunner(subject, history.steps)
    runner.run()
    inp = subject.inputs()
    if interleave:
        after = runner.interleaved(inp)
        subject.check(inp, after, "after its history, another family run between its prepare and replay")
    else:
        after = subject.run_and_check(inp, "after its history")
    fresh = Subject(suite, case, mode, path, capacity, materialized=m).run(inp)
    ctx, what = subject.ctx, f"{mode} after its history vs a fresh backend"
    assert_outputs_close(after, fresh, ctx, what, moe_in=True)
    rows = base_row_mask(inp.batch.token_lora_mapping, after.y.device)
    assert_bitwise(after.y[rows], fresh.y[rows], ctx, f"{what}: base rows")
