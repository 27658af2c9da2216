"""P09: sentinel expert ids add nothing; IDLE batches launch nothing and leave no stale state.

Routing is drawn with a high share of sentinel ids — negative (expert parallelism: not handled
here) and, where the base layer has extra fused experts, ids in ``[E, E_base)`` (base only). The
run equals the oracle (which gives sentinels no LoRA), its LoRA delta equals the oracle's, a token
whose every pair is negative gets an output of exactly zero, and a token without a LoRA expert
among its pairs is bit-identical to the LoRA-disabled run. Then an IDLE batch: eagerly it launches
no Triton kernel; in a graph mode it replays with every row a pad row, bit-identical to LoRA
disabled. The batch run again after it equals the oracle and its first run.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import assert_bitwise, assert_close
from moelora_conformance.harness.inputs import BatchInputs
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import (
    Subject,
    draw_capacity,
    draw_case,
    draw_moe_path,
    draw_routing,
    trace,
)
from moelora_core.batch import BatchSpec
from moelora_core.forward_mode import ForwardMode
from moelora_core.graphs.triton_launches import intercept_triton_launches
from moelora_core.tolerance import assert_exact

SENTINEL_SHARES = (0.3, 0.6, 1.0)


def _empty_inputs(subject: Subject, batch: BatchSpec) -> BatchInputs:
    m = subject.m
    return BatchInputs(batch, m.x[:0], m.topk_ids[:0], m.topk_weights[:0], {k: t[:0] for k, t in m.dense_x.items()})


@conformance("P09")
@given(data=st.data())
def test_sentinel_experts_and_idle_batches_add_nothing(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    drawn = draw_case(data, suite, mode, dtype, kinds=("extend", "decode", "mixed"))
    case = draw_routing(data, drawn, SENTINEL_SHARES, label="sentinel routing")
    path = draw_moe_path(data, suite)
    capacity = draw_capacity(data, mode, [case.batch])
    subject = Subject(suite, case, mode, path, capacity)
    inp = subject.inputs()
    first = subject.run_and_check(inp, "sentinel-heavy batch")
    base = subject.disabled(inp, first)
    ids = inp.topk_ids
    E = subject.layer.spec.E
    all_negative = (ids < 0).all(dim=1)
    no_lora_expert = ((ids < 0) | (ids >= E)).all(dim=1)
    ctx = subject.ctx
    zero = torch.zeros_like(first.y[all_negative])
    what = ctx.what(f"{mode}: MoE output of tokens whose every expert id is < 0 (must be zero)")
    assert_exact(first.y[all_negative], zero, what=what, seed=ctx.seed)
    assert_bitwise(first.y[no_lora_expert], base.y[no_lora_expert], ctx,
                   f"{mode}: MoE output of tokens without a LoRA expert vs LoRA disabled")
    b = case.batch
    idle = _empty_inputs(subject, BatchSpec(ForwardMode.IDLE, (), b.max_loras, b.lora_ranks, b.scalings))
    trace("IDLE batch")
    if mode == "eager":
        launches = []

        def count(kernel, run, args, kwargs, grid):
            launches.append(getattr(kernel, "__name__", repr(kernel)))
            return run(kernel, *args, grid=grid, warmup=False, **kwargs)

        with intercept_triton_launches(count):
            out = subject.run(idle)
        if launches:
            raise AssertionError(f"eager IDLE batch launched {len(launches)} Triton kernels: {launches[:5]} | "
                                 f"{ctx.describe}")
        if out.y.shape[0] != 0 or any(t.shape[0] for t in out.dense.values()):
            raise AssertionError(f"eager IDLE batch produced rows | {ctx.describe}")
    else:
        out = subject.run(idle)
        subject.check(idle, out, "IDLE replay (every row a pad row)")
    again = subject.run_and_check(inp, "the batch again after IDLE")
    assert_close(again.y, first.y.double(), ctx, f"{mode}: the batch after IDLE vs its first run")
