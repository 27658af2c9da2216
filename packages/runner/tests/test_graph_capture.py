"""Capture and replay discipline of the graph runners (DESIGN.md §3, §6), on the CPU emulator (real
CUDA graphs and ``set_sync_debug_mode("error")`` with ``MOELORA_RUNNER_DEVICE=cuda``).

- ``test_a_host_sync_in_a_captured_forward_fails_the_capture``: a ``.item()`` slipped into the model's
  post-attention step raises ``HostSyncError`` at capture (full, breakable and the decode graph); the
  bucket stays uncaptured and, once the leak is gone, the same engine serves the request as a clean
  engine does.
- ``test_replay_and_breakable_attention_run_under_the_guard``: a host read in the eager attention of
  ``breakable`` fails under the guard at replay (in ``full`` the same read fails the capture), and one
  in the LM head after the replay fails under the guard in every mode.
- ``test_capture_never_runs_with_has_active_lora_false``: every capture batch (an IDLE batch) was
  prepared with ``has_active_lora`` True, one capture per bucket built, each bucket on its own backend
  instance; a backend that answers the capture batch with False is refused with
  ``GraphCaptureError`` (at the first use of a lazy bucket, and at start-up capture).
- ``test_backend_static_buffers_that_move_are_refused``: a backend returning a fresh metadata tensor
  after capture is refused by name instead of replaying the captured one.
- ``test_every_bucket_backend_hears_every_slot_load``: each bucket's backend instance gets the slot
  hook for every slot of every layer pool when it is built and again at every later load.
"""

from __future__ import annotations

import graph_support as gs
import pytest
import runner_support as rs

from moelora_core import HostSyncError
from moelora_runner.errors import GraphCaptureError

MODEL = "olmoe"
#: Buckets captured on first use on CUDA too, so a leak patched in before the first step meets a capture.
SMALL = dict(max_loras=2, max_num_batched_tokens=8, kv_cache_tokens=128, prefill_token_buckets=(8,),
             decode_batch_buckets=(2, 4), graph_capture="lazy")
REQUEST = dict(request_id="a", prompt_token_ids=[4, 5, 6], max_new_tokens=2, ignore_eos=True, logprobs=2)

pytestmark = [pytest.mark.cudagraph, pytest.mark.xdist_group("graphs-reference")]


def _engine(make_engine, mode, **kwargs):
    return make_engine(MODEL, adapters=False, dtype=gs.DTYPE, **{**SMALL, **kwargs}, **gs.MODES[mode])


@pytest.mark.parametrize("mode", ["full", "breakable", "decode_graph"])
def test_a_host_sync_in_a_captured_forward_fails_the_capture(mode, make_engine, monkeypatch):
    clean = _engine(make_engine, "eager").generate([REQUEST])[0]
    engine = _engine(make_engine, mode)
    post = engine.model.post_attention

    def leaky(i, attn, h, fb, lora):
        attn.sum().item()  # a host read of device data
        return post(i, attn, h, fb, lora)

    if mode == "decode_graph":  # the prompt runs eagerly first, the leak then meets the decode capture
        engine.add_request(REQUEST)
        engine.step()
    else:
        engine.add_request(REQUEST)
    monkeypatch.setattr(engine.model, "post_attention", leaky)
    with pytest.raises(HostSyncError, match="capture"):
        engine.step()
    runner = engine.runner.decode_graph if mode == "decode_graph" else engine.runner.prefill_graph
    assert not any(b.captured for b in runner.buckets.values()) and runner.captures == 0
    monkeypatch.setattr(engine.model, "post_attention", post)
    done = []
    while engine.has_unfinished():  # the failed step computed nothing: the same engine goes on
        done += engine.step()
    gs.compare_outputs(done, [clean], what=f"{mode} after a refused capture")
    assert runner.captures == 1


@pytest.mark.parametrize("where", ["attention", "logits"])
@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_replay_and_breakable_attention_run_under_the_guard(mode, where, make_engine, monkeypatch):
    engine = _engine(make_engine, mode)
    inner = getattr(engine.model, where)

    def leaky(*args):
        args[-2 if where == "attention" else -1].positions.sum().item()  # the ForwardBatch's device data
        return inner(*args)

    monkeypatch.setattr(engine.model, where, leaky)
    engine.add_request(REQUEST)
    expected = "capture" if (mode, where) == ("full", "attention") else "host_sync_guard"
    with pytest.raises(HostSyncError, match=expected):
        engine.step()


def test_capture_never_runs_with_has_active_lora_false(make_engine, engine_adapters):
    gs.GRAPH_PREPARES.clear()
    engine = make_engine(MODEL, backend="graph_support:make_spying_backend", dtype=gs.DTYPE, **SMALL,
                         **gs.MODES["full"])
    names = [n for n, _ in engine_adapters[MODEL]]
    engine.generate([dict(REQUEST, request_id=f"r{i}", adapter=[None, names[0]][i % 2]) for i in range(3)])
    buckets = [*engine.runner.prefill_graph.buckets.values(), *engine.runner.decode_graph.buckets.values()]
    captures = [(b, active) for b, bs, active in gs.GRAPH_PREPARES if bs == 0]
    assert engine.runner.prefill_graph.buckets and engine.runner.decode_graph.buckets
    assert len(captures) == len(buckets) and all(active for _, active in captures), captures
    assert sorted(i for i, _ in captures) == sorted(id(b.backend) for b in buckets)
    assert len({id(b.backend) for b in buckets} | {id(engine.backend)}) == len(buckets) + 1, "one backend per bucket"
    assert all(b.capture_info.has_active_lora and b.capture_info.use_cuda_graph for b in buckets)

    inactive = make_engine(MODEL, backend="graph_support:make_inactive_capture_backend", dtype=gs.DTYPE, **SMALL,
                           **gs.MODES["full"])
    inactive.add_request(REQUEST)
    with pytest.raises(GraphCaptureError, match="has_active_lora False"):
        inactive.step()
    with pytest.raises(GraphCaptureError, match="has_active_lora False"):
        make_engine(MODEL, backend="graph_support:make_inactive_capture_backend", dtype=gs.DTYPE,
                    **{**SMALL, "graph_capture": "startup"}, **gs.MODES["breakable"])


def test_backend_static_buffers_that_move_are_refused(make_engine):
    engine = make_engine(MODEL, adapters=False, backend="graph_support:make_reallocating_backend", dtype=gs.DTYPE,
                         **SMALL, **gs.MODES["full"])
    engine.add_request(REQUEST)
    with pytest.raises(GraphCaptureError, match=r"other than the captured ones for \['weight_indices'\]"):
        engine.step()


def test_every_bucket_backend_hears_every_slot_load(make_engine, engine_adapters):
    rs.HOOK_CALLS.clear()
    engine = make_engine(MODEL, adapters=False, backend="runner_support:make_hooked_backend", dtype=gs.DTYPE,
                         **{**SMALL, "max_loras": 1}, **gs.MODES["full"])
    (a, path_a), (b, path_b) = engine_adapters[MODEL][:2]
    engine.load_adapter(a, path_a)
    engine.load_adapter(b, path_b)
    pools = {id(p) for p in engine.adapters.pools}
    engine.generate([dict(REQUEST, adapter=a)])  # the prefill and decode buckets are built after a's load
    buckets = [*engine.runner.prefill_graph.buckets.values(), *engine.runner.decode_graph.buckets.values()]
    assert len(buckets) == 2
    for bucket in buckets:  # told of slot 0 in every pool when attached
        assert {(s, p) for i, s, p in rs.HOOK_CALLS if i == id(bucket.backend)} == {(0, p) for p in pools}
    before = len(rs.HOOK_CALLS)
    engine.generate([dict(REQUEST, request_id="b", adapter=b)])  # b evicts a: every instance hears it
    later = rs.HOOK_CALLS[before:]
    for backend in (engine.backend, *(bucket.backend for bucket in buckets)):
        assert sorted(p for i, s, p in later if i == id(backend)) == sorted(pools), backend
