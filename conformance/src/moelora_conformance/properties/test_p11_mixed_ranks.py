"""P11: mixed ranks, r < R, rsLoRA and different σ in one batch.

The pool is built so one batch holds all of it: slot 0 an rsLoRA adapter (σ = α/√r) of rank r < R,
slot 1 a plain adapter (σ = α/r) of another rank and σ whose gate module has its own rank
(``rank_pattern``), further slots drawn or empty; the batch has requests on slot 0, slot 1 and
base (in a drawn order) among drawn others. σ is drawn as scale · ratio
(``strategies.adapters.sigmas``): usually a value bf16 / fp16 cannot hold, so a σ rounded through
the activation dtype shows in fp32 runs. The run equals the oracle — σ applied per module at run
time, ranks zero-padded to R — with its deltas and base rows.
"""

import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, draw_moe_path, trace
from moelora_conformance.strategies.adapters import SlotAdapter, pool_ranks, pool_scalings, sigmas, slot_adapters
from moelora_conformance.strategies.batches import BatchPlan
from moelora_conformance.strategies.suite import mode_forward, pool_batches, tokens_per_request
from moelora_core.batch import BatchSpec, Request
from moelora_core.forward_mode import ForwardMode
from moelora_core.layer_spec import MOE_MODULES
from moelora_core.sentinels import NO_ADAPTER


def _adapter(rank, sigma, rslora, modules, gate_rank=None):
    alpha = sigma * (math.sqrt(rank) if rslora else rank)
    mods = []
    for m in modules:
        r = gate_rank if (m == "gate" and gate_rank is not None) else rank
        mods.append((m, r, sigma * (math.sqrt(r) if rslora else r)))
    return SlotAdapter(rank, alpha, rslora, tuple(mods))


@conformance("P11")
@given(data=st.data())
def test_mixed_ranks_rslora_and_scalings_in_one_batch(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    caps = suite.caps
    drawn = draw_case(data, suite, mode, dtype, kinds=("extend", "decode", "mixed"))
    shape = replace(drawn.shape, max_loras=max(drawn.shape.max_loras, min(3, caps.max_loras)),
                    max_rank=max(drawn.shape.max_rank, min(2, caps.max_rank)))
    R = shape.max_rank
    modules = [*MOE_MODULES, *(m for m, _ in shape.dense_shapes)]
    r0 = data.draw(st.integers(1, max(1, R - 1)), label="rsLoRA rank (< R)")
    r1 = data.draw(st.integers(1, R), label="plain rank")
    s0 = data.draw(sigmas(), label="rsLoRA sigma")
    s1 = data.draw(sigmas(exclude=s0), label="plain sigma")
    gate_rank = data.draw(st.integers(1, R), label="plain adapter's gate rank (rank_pattern)")
    pool = [_adapter(r0, s0, True, modules), _adapter(r1, s1, False, modules, gate_rank)]
    for slot in range(2, shape.max_loras):
        pool.append(data.draw(st.one_of(st.none(), slot_adapters(shape)), label=f"slot {slot}"))
    pool = tuple(pool)
    like = BatchSpec(ForwardMode.IDLE, (), shape.max_loras, pool_ranks(pool), pool_scalings(pool))
    fmode = mode_forward(mode, drawn.batch)
    tpr = tokens_per_request(drawn.batch)
    limit = max(3, min(caps.max_requests, caps.max_tokens // tpr))
    n = data.draw(st.integers(3, limit), label="requests")
    batch = data.draw(pool_batches(like, fmode, n, max_tokens=max(caps.max_tokens, 3 * tpr), tokens_per_request=tpr),
                      label="batch")
    where = data.draw(st.permutations(range(n)), label="positions of slot 0, slot 1 and base")[:3]
    slots = [r.slot for r in batch.requests]
    for pos, slot in zip(where, (0, 1, NO_ADAPTER)):
        slots[pos] = slot
    requests = [Request(s, r.extend_len, r.prefix_len) for s, r in zip(slots, batch.requests)]
    batch = BatchSpec(batch.forward_mode, requests, batch.max_loras, batch.lora_ranks, batch.scalings)
    plan = BatchPlan(batch, drawn.plan.kind if fmode is drawn.batch.forward_mode else "extend", "mixed-ranks", "drawn")
    case = replace(drawn, shape=shape, pool=pool, plan=plan)
    trace(f"mixed-rank case: {case.describe()}")
    path = draw_moe_path(data, suite)
    capacity = draw_capacity(data, mode, [batch])
    subject = Subject(suite, case, mode, path, capacity)
    subject.run_and_check(subject.inputs(), "mixed ranks and scalings")
