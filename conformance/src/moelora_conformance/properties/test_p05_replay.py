"""P05: replay equals eager, including a small batch replayed right after a larger one, from 1 to
``max_num_requests`` (> 32 where the caps allow) requests, and after an adapter was loaded since
the capture.

The graph family gets a request capacity drawn in [33, the caps] (decode: one token per request),
the layer is captured on a batch that fills it, then replays a drawn smaller batch and a
one-request batch. In half the examples another adapter (or new weights of the slot's own config,
as RL weight sync reloads) is loaded into a used slot (or the slot cleared) after the capture, as a
server loads adapters into graphs captured at start-up — with the pool's R raised past its adapters'
ranks in half the cases, so the new adapter can be larger than any captured with
(``history.draw_reload``, ``draw_rank_headroom``); in a third of the examples the load goes into a
slot that was empty at the capture (emptied before it where the pool had none: a hot load). Later
batches describe the reloaded pool, and their first request reads the reloaded slot. Every replay
equals an eager run of the same batch on the same backend (within the dtype's tolerance) and the
oracle of the pool as it is, and leaves every pad row bit-identical to the LoRA-disabled run — a
tail left from the larger batch would add LoRA there.
"""

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import derive_inputs
from moelora_conformance.properties.history import draw_rank_headroom, draw_reload, on_pool
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import (
    Subject,
    assert_outputs_close,
    draw_case,
    draw_moe_path,
    trace,
)
from moelora_conformance.strategies.choice import uniform, weighted
from moelora_conformance.strategies.suite import mode_forward, pool_batches
from moelora_core.backend_checks import GraphCapacity
from moelora_core.forward_mode import ForwardMode

#: The public 32-request cap some engines had: capacities go past it.
PAST_CAP = 33


@conformance("P05")
@given(data=st.data())
def test_replay_equals_eager_after_a_larger_batch(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    caps = suite.caps
    case = draw_rank_headroom(data, suite, draw_case(data, suite, mode, dtype, kinds=("extend", "decode", "mixed")))
    path = draw_moe_path(data, suite)
    m = case.materialize(suite.device)
    like = case.batch
    fmode = mode_forward(mode, like)
    most = min(caps.max_requests, caps.max_tokens)
    max_requests = data.draw(st.integers(min(PAST_CAP, most), most), label="request capacity")
    # A decode batch in a prefill mode takes a prefill capacity of one token per request.
    if fmode is ForwardMode.DECODE:
        tokens = max_requests
    else:
        tokens = data.draw(st.integers(max_requests, caps.max_tokens), label="token capacity")
    capacity = GraphCapacity.decode(max_requests) if mode == "decode" else GraphCapacity.prefill(tokens, max_requests)
    trace(f"capacity: {capacity}")
    small = data.draw(st.integers(1, max_requests), label="requests of the smaller batch")
    sizes = [max_requests, small, 1]
    subject = Subject(suite, case, mode, path, capacity, materialized=m)
    pool = case.pool
    # "held" first: the simplest example reloads a slot that held an adapter at the capture
    into = data.draw(weighted([("held", 2), ("empty at the capture", 1)]), label="slot reloaded after the capture")
    hot = None
    if into != "held":  # a hot load: a slot no adapter held when the graph was captured
        empty = [s for s, a in enumerate(pool) if a is None]
        hot = data.draw(uniform(empty or list(range(case.shape.max_loras))), label="hot-loaded slot")
        if pool[hot] is not None:
            trace(f"slot {hot} emptied before the capture")
            subject.layer.reload(hot, None, case.seed * 7 + 41)
            pool = tuple(None if s == hot else a for s, a in enumerate(pool))
    reload = None
    for i, n in enumerate(sizes):
        # True first: the simplest example (tried first) reloads a slot after the capture
        if i == 1 and (hot is not None or data.draw(uniform((True, False)), label="reload a slot after the capture")):
            slots = [hot] if hot is not None else [s for s, a in enumerate(pool) if a is not None]
            reload = draw_reload(data, case, pool, slots, seed=case.seed * 7 + 51, label="reload")
            trace(f"{'hot load' if hot is not None else 'reload'} after the capture: {reload.describe()}")
            subject.layer.reload(reload.slot, reload.adapter, reload.seed)
            pool = reload.applied(pool)
        batch = data.draw(pool_batches(on_pool(like, pool), fmode, n, max_tokens=capacity.max_tokens,
                                       tokens_per_request=1), label=f"batch {i}")
        if reload is not None:  # the batches after a reload read the reloaded slot
            batch = reload.with_slot_used(batch)
        inp = derive_inputs(case, m, batch, seed=case.seed + 11 * (i + 1))
        replayed = subject.run_and_check(inp, f"replay {i} ({n} requests)")
        eager = subject.layer.eager(inp)
        assert_outputs_close(replayed, eager, subject.ctx, f"{mode} replay {i} ({n} requests) vs eager")
