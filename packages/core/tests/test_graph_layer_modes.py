"""LayerGraph: the layer harness graph modes (dense LoRA projection -> break op -> MoE layer).

Covers: ``breakable`` replays equal eager while the break op reads live host metadata between
the two graphs; ``full`` replays equal eager when the break op reads static buffers; ``full``
with a break op that reads live host metadata freezes it (the fault the mode exposes); small
batches after large ones; the errors (unknown mode, replay before capture, capturing twice, a
break op whose output changes shape).
"""

import pytest
import torch

from moelora_core import DEFAULT_POLICY, InvalidFieldError
from moelora_core.graphs import GraphPool, LayerGraph

pytestmark = pytest.mark.cudagraph

T, HID, R, E, K = 12, 6, 2, 4, 2  # token capacity, hidden, LoRA rank, experts, top_k
BATCHES = ([5, 4, 3], [2], [1, 6, 2, 3], [12])  # request lengths; small after large


class Layer:
    """Static inputs, live metadata, and the three callables."""

    def __init__(self, seed=0, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.x = torch.zeros(T, HID, device=device)
        self.seg_ids = torch.full((T,), -1, dtype=torch.int64, device=device)  # static: token -> request
        self.lens = []  # live host metadata
        self.W = torch.randn(HID, HID, generator=g).to(device)
        self.A, self.B = torch.randn(HID, R, generator=g).to(device), torch.randn(R, HID, generator=g).to(device)
        self.sigma = torch.tensor(0.5, device=device)
        self.router = torch.randn(HID, E, generator=g).to(device)
        self.experts = (torch.randn(E, HID, HID, generator=g) / HID).to(device)

    def load(self, lens, seed):
        n = sum(lens)
        g = torch.Generator().manual_seed(seed)
        self.x[:n] = torch.randn(n, HID, generator=g).to(self.device)
        self.x[n:] = 0
        ids = [r for r, length in enumerate(lens) for _ in range(length)]
        self.seg_ids.copy_(torch.tensor(ids + [-1] * (T - n)).to(self.device))
        self.lens = list(lens)

    def projection(self):
        return self.x @ self.W + self.sigma * ((self.x @ self.A) @ self.B)

    def break_live(self, a):
        # attention-like: each token gets its request's mean, from live host lengths
        out = torch.zeros_like(a)
        start = 0
        for length in self.lens:
            out[start : start + length] = a[start : start + length].mean(0)
            start += length
        return out

    def break_static(self, a):
        # the same from static device buffers only (graph-safe)
        valid = self.seg_ids >= 0
        ids = self.seg_ids.clamp(min=0)
        sums = torch.zeros(T, HID, device=a.device).index_add_(0, ids, torch.where(valid[:, None], a, 0.0))
        counts = torch.zeros(T, device=a.device).index_add_(0, ids, valid.float()).clamp(min=1.0)
        return torch.where(valid[:, None], (sums / counts[:, None])[ids], 0.0)

    def moe(self, b):
        probs = torch.softmax(b @ self.router, dim=-1)
        weights, ids = torch.topk(probs, K, dim=-1)
        per_expert = torch.einsum("th,tkho->tko", b, self.experts[ids])
        return (weights[..., None] * per_expert).sum(1)


def _run(mode, break_name, device="cpu"):
    layer = Layer(device=device)
    break_op = getattr(layer, break_name)
    layer.load(BATCHES[0], seed=0)
    harness = LayerGraph(layer.projection, break_op, layer.moe, mode=mode, pool=GraphPool("prefill", device))
    harness.capture()
    results = []
    for i, lens in enumerate(BATCHES):
        layer.load(lens, seed=i)
        replay = harness.replay().clone()
        results.append((replay, harness.eager()))
    return harness, results


@pytest.mark.parametrize(("mode", "break_name"), [("breakable", "break_live"), ("full", "break_static"),
                                                  ("breakable", "break_static")])
def test_replay_equals_eager_in_every_batch(mode, break_name):
    harness, results = _run(mode, break_name)
    assert len(harness.graphs) == (2 if mode == "breakable" else 1)
    for i, (replay, eager) in enumerate(results):
        DEFAULT_POLICY.assert_close(replay, eager, dtype=torch.float32, what=f"{mode} batch {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("mode", "break_name"), [("breakable", "break_live"), ("full", "break_static")])
def test_cuda_graph_replay_equals_eager_in_every_batch(mode, break_name):
    harness, results = _run(mode, break_name, device="cuda")
    assert {g.kind for g in harness.graphs} == {"cuda"}
    for i, (replay, eager) in enumerate(results):
        DEFAULT_POLICY.assert_close(replay, eager, dtype=torch.float32, device="cuda", tf32=True,
                                    what=f"{mode} batch {i}")


def test_full_graph_freezes_live_host_metadata():
    # the break op's Python loop over live lengths runs once, at capture: later batches replay
    # the first batch's segments
    _, results = _run("full", "break_live")
    assert torch.equal(results[0][0], results[0][1])
    assert not torch.allclose(results[1][0], results[1][1])


def test_layer_graph_errors():
    layer = Layer()
    pool = GraphPool("prefill", "cpu")
    with pytest.raises(InvalidFieldError, match="unknown layer graph mode"):
        LayerGraph(layer.projection, layer.break_live, layer.moe, mode="piecewise", pool=pool)
    harness = LayerGraph(layer.projection, lambda a: a[: T // 2] if layer.lens == [1] else a, layer.moe,
                         mode="breakable", pool=pool)
    with pytest.raises(InvalidFieldError, match="capture"):
        harness.replay()
    layer.load([3, 3], seed=1)
    harness.capture()
    with pytest.raises(InvalidFieldError, match="already captured"):
        harness.capture()
    layer.load([1], seed=2)
    with pytest.raises(InvalidFieldError, match=r"returned \(6, 6\)"):
        harness.replay()
