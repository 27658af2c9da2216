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
  prepared with ``has_active_lora`` True, one capture per bucket built, every bucket on the engine's
  one backend instance; a backend that answers the capture batch with False is refused with
  ``GraphCaptureError`` (at the first use of a lazy bucket, and at start-up capture).
- ``test_one_backend_per_engine_and_buckets_alias_one_buffer_set``: the backend factory runs once per
  engine, whatever the buckets; two buckets of a family read views of one buffer set (the backend's
  metadata and the static batch start at the same addresses, the smaller inside the larger), and the
  decode and prefill families share no storage.
- ``test_backend_static_buffers_that_move_are_refused``: a backend returning a fresh metadata tensor
  after capture is refused by name instead of replaying the captured one.
- ``test_slot_loads_reach_the_backend_once``: the backend hears of every slot load, reload and clear
  once per layer pool, however many buckets were captured.
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
    assert {i for i, _ in captures} == {id(engine.backend)}, "every bucket on the engine's one backend"
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


def test_one_backend_per_engine_and_buckets_alias_one_buffer_set(make_engine):
    gs.BACKENDS_BUILT.clear()
    engine = make_engine(MODEL, adapters=False, backend="graph_support:make_counting_backend", dtype=gs.DTYPE,
                         **{**SMALL, "prefill_token_buckets": (4, 8)}, **gs.MODES["full"])
    engine.runner.capture_all()
    engine.generate([REQUEST])
    assert gs.BACKENDS_BUILT == [id(engine.backend)], "one backend instance per engine"
    families = {"decode": engine.runner.decode_graph, "prefill": engine.runner.prefill_graph}
    storages = {}
    for family, runner in families.items():
        small, large = (runner.buckets[s] for s in runner.sizes)
        assert small.backend is large.backend is engine.backend and small.static is large.static
        a, b = small.capture_info.device_tensors(), large.capture_info.device_tensors()
        assert a.keys() == b.keys()
        for name in a:  # the smaller bucket's view starts where the larger one's does, and is no longer
            assert a[name].data_ptr() == b[name].data_ptr() and a[name].numel() <= b[name].numel(), (family, name)
        assert small.capture_info.num_tokens < large.capture_info.num_tokens
        views = [runner.static.forward_batch(None, tokens=x.tokens, requests=x.requests) for x in (small, large)]
        assert views[0].input_ids.data_ptr() == views[1].input_ids.data_ptr()
        assert (views[0].num_tokens, views[1].num_tokens) == (small.tokens, large.tokens)
        storages[family] = {t.untyped_storage().data_ptr() for t in b.values()}
    assert not storages["decode"] & storages["prefill"], "decode and prefill families share no storage"


def test_slot_loads_reach_the_backend_once(make_engine, engine_adapters):
    rs.HOOK_CALLS.clear()
    engine = make_engine(MODEL, adapters=False, backend="runner_support:make_hooked_backend", dtype=gs.DTYPE,
                         **{**SMALL, "max_loras": 1}, **gs.MODES["full"])
    (a, path_a), (b, path_b) = engine_adapters[MODEL][:2]
    engine.load_adapter(a, path_a)
    engine.load_adapter(b, path_b)
    pools = sorted(id(p) for p in engine.adapters.pools)
    engine.runner.capture_all()
    assert len(engine.runner.prefill_graph.buckets) + len(engine.runner.decode_graph.buckets) == 3
    assert rs.HOOK_CALLS == [], "capturing buckets announces nothing"
    engine.generate([dict(REQUEST, adapter=a)])  # a is loaded into slot 0
    assert sorted(p for i, s, p in rs.HOOK_CALLS) == pools and {(i, s) for i, s, _ in rs.HOOK_CALLS} == \
        {(id(engine.backend), 0)}, "one call per layer pool, on the one backend"
    before = len(rs.HOOK_CALLS)
    engine.generate([dict(REQUEST, request_id="b", adapter=b)])  # b evicts a: the backend hears it once per pool
    later = rs.HOOK_CALLS[before:]
    assert sorted(p for _, _, p in later) == pools and {i for i, _, _ in later} == {id(engine.backend)}


def test_buckets_capture_under_the_pools_warm_up_rule():
    # DESIGN.md §6, "Warm-up and capture": a bucket names no warm-up, so it captures under
    # GraphPool.default_warmup, as the suite's LayerGraph does (packages/core/tests/test_graph_api.py)
    import inspect

    from moelora_runner.graph_runner import GraphBucket

    assert "warmup" not in inspect.getsource(GraphBucket)
