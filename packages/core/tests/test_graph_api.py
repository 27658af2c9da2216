"""GraphPool / CapturedGraph: the one API over CUDA graphs and the emulator.

Covers: one pool per family, ``kind`` chosen from the device and documented values, refusals
(unknown family or kind, "cuda" without CUDA, negative warm-up), warm-up runs eagerly before
capture, replay returns the same output object every time, graphs of a pool are listed; on a GPU
(marked ``gpu``) the same program agrees bit for bit between kind "cuda" and kind "emulated".
"""

import pytest
import torch

from moelora_core import GRAPH_FAMILIES, HostSyncError, InvalidFieldError
from moelora_core.graphs import GRAPH_KINDS, GraphPool, graph_pools

pytestmark = pytest.mark.cudagraph


def test_one_pool_per_family_with_the_device_kind():
    pools = graph_pools("cpu")
    assert tuple(pools) == GRAPH_FAMILIES
    assert {p.kind for p in pools.values()} == {"emulated"}
    assert GRAPH_KINDS == ("cuda", "emulated")
    assert pools["decode"] is not pools["prefill"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"family": "extend"}, "family"),
        ({"family": "decode", "kind": "hip"}, "kind"),
        ({"family": "decode", "kind": "cuda"}, "kind"),  # a CPU device cannot hold CUDA graphs
    ],
)
def test_pool_refusals_name_the_field(kwargs, field):
    with pytest.raises(InvalidFieldError) as exc:
        GraphPool(device="cpu", **kwargs)
    assert exc.value.field == field


def test_warmup_runs_eagerly_and_replay_returns_the_same_output():
    calls = []
    x = torch.arange(4.0)
    pool = GraphPool("prefill", "cpu")

    def forward():
        calls.append(1)
        return x * 3

    with pytest.raises(InvalidFieldError, match="warmup"):
        pool.capture(forward, warmup=-1)
    graph = pool.capture(forward, warmup=2)
    assert len(calls) == 3  # two warm-ups, one capture
    assert graph.kind == "emulated" and graph.family == "prefill"
    first = graph.replay()
    x.add_(1)
    assert graph.replay() is first is graph.output
    assert torch.equal(first, (torch.arange(4.0) + 1) * 3)
    assert len(calls) == 3  # replay does not call the Python function
    assert pool.graphs == [graph]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["frozen_scalar", "device_count", "stale_tail", "host_sync_item", "views_inplace_out"])
def test_cuda_graph_and_emulator_agree_on_cuda(name):
    import graph_programs as gp

    prog = gp.BY_NAME[name]
    cuda = gp.run_program(prog, "cuda", "cuda", seed=1)
    emulated = gp.run_program(prog, "cuda", "emulated", seed=1)
    assert gp.check_run(prog, cuda) == [] and gp.check_run(prog, emulated) == []
    assert (cuda.error is None) == (emulated.error is None)
    assert all(gp.same(a, b) for a, b in zip(cuda.replay, emulated.replay))


def _kinds():
    return ["emulated"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("kind", _kinds())
def test_a_failed_cuda_capture_leaves_its_pool_usable(kind):
    # Regression (H200, the engine's graph tests): a capture invalidated by a host sync left the CUDA
    # caching allocator recording into the pool, so the family's next capture failed ("already
    # recording to mempool_id") and later work with "invalid argument".
    device = "cuda" if kind == "cuda" else "cpu"
    pool = GraphPool("prefill", device, kind=kind)
    x = torch.randn(8, device=device)

    def leaky():
        return x * float(x.sum().item())  # a host read: refused during capture

    before = torch.cuda.current_stream() if kind == "cuda" else None
    with pytest.raises(HostSyncError):
        pool.capture(leaky, warmup=0)
    if kind == "cuda":  # torch.cuda.graph left the thread on its capture stream after the failure
        assert torch.cuda.current_stream() == before
    graph = pool.capture(lambda: x * 2.0, warmup=0)
    x.copy_(torch.randn(8, device=device))
    assert torch.equal(graph.replay(), x * 2.0)
    staged = torch.empty(8, device=device)
    staged.copy_(torch.arange(8.0).pin_memory() if kind == "cuda" else torch.arange(8.0), non_blocking=True)
    assert torch.equal(staged.cpu(), torch.arange(8.0))


@pytest.mark.parametrize("kind", _kinds())
def test_a_collection_during_capture_cannot_free_cuda_objects(kind):
    # Regression (H200, the engine's graph tests in one process): an automatic collection inside a
    # breakable capture freed an earlier engine's CUDA graph, whose destructor invalidated the
    # capture ("operation failed due to a previous error during capture"). The collector is off
    # inside every capture (so no automatic collection can run there) and back on after it, and
    # cyclic garbage that holds a captured graph is freed outside the capture.
    import gc
    import weakref

    device = "cuda" if kind == "cuda" else "cpu"
    old = GraphPool("decode", device, kind=kind)
    y = torch.randn(8, device=device)

    class Holder:  # an engine-like cycle that owns a captured graph
        pass

    holder = Holder()
    holder.graph, holder.me = old.capture(lambda: y + 1.0, warmup=0), holder
    freed = []
    weakref.finalize(holder, freed.append, True)
    del holder
    old.graphs.clear()
    pool = GraphPool("prefill", device, kind=kind)
    x = torch.randn(8, device=device)
    collector = []

    def fn():
        collector.append(gc.isenabled())
        return x * 3.0

    assert gc.isenabled()
    graph = pool.capture(fn, warmup=1)
    assert collector == [True, False], "warm-up runs with the collector, the capture without it"
    assert gc.isenabled()
    gc.collect()
    assert freed == [True]
    x.copy_(torch.randn(8, device=device))
    assert torch.equal(graph.replay(), x * 3.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the emulator has no streams)")
def test_capture_runs_on_the_warmup_stream():
    # SGLang's LoraWorkspace keys its graph scratch by the current raw CUDA stream and refuses a
    # capture on a stream it was not warmed on ("MoE LoRA workspace was not warmed before CUDA
    # capture"); a capture on torch's own capture stream missed every key (the first peers H100 run).
    pool = GraphPool("decode", "cuda")
    x = torch.randn(8, device="cuda")
    scratch: dict[int, torch.Tensor] = {}

    def fn():
        key = torch.cuda.current_stream().cuda_stream
        if torch.cuda.is_current_stream_capturing():
            if key not in scratch:
                raise RuntimeError("scratch was not warmed on the capture stream")
        else:
            scratch.setdefault(key, torch.empty(8, device="cuda"))
        return torch.mul(x, 3.0, out=scratch[key])

    before = torch.cuda.current_stream()
    graph = pool.capture(fn, warmup=1)
    assert torch.cuda.current_stream() == before
    x.copy_(torch.randn(8, device="cuda"))
    assert torch.equal(graph.replay(), x * 3.0)


@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_the_harness_and_the_engine_capture_under_one_warm_up_rule(mode):
    # DESIGN.md §6, "Warm-up and capture": the suite's LayerGraph and the engine's GraphBucket
    # (packages/runner/tests/test_graph_capture.py) name no warm-up and take the pool's (0 on the emulator, 1 on CUDA), so an emulated capture is the
    # callable's first call in both — state a backend keeps on the info object is not primed by an
    # eager call the engine never makes
    from moelora_core.graphs import LayerGraph

    pool = GraphPool("prefill", "cpu")
    assert pool.default_warmup == 0 and GraphPool.default_warmup.fget(type("P", (), {"kind": "cuda"})()) == 1
    calls = {"projection": 0, "break": 0, "moe": 0}
    x = torch.randn(4, 3)

    def part(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    graph = LayerGraph(part("projection", lambda: x * 2.0), part("break", lambda a: a + 1.0),
                       part("moe", lambda b: b * 3.0), mode=mode, pool=pool)
    graph.capture()
    # full: one capture of the three; breakable: the projection captured, then run once eagerly with
    # the break op for the MoE segment's static input (the engine's breakable bucket replays the
    # captured segment instead), and the MoE segment captured
    expected = {"projection": 1, "break": 1, "moe": 1} if mode == "full" else {"projection": 2, "break": 1, "moe": 1}
    assert calls == expected
    assert torch.equal(graph.replay(), (x * 2.0 + 1.0) * 3.0)
