"""Triton launches inside an emulated capture (CPU, Triton interpreter).

Covers: a kernel reading a device-side count replays correctly with new data written into the
static inputs (small batch after a large one); the launch is recorded once with its callable
grid evaluated from the meta-parameters and frozen; op recording pauses inside the launch (the
interpreter's own torch ops are not recorded); the interception is removed after capture.
"""

import os

import pytest
import torch

from moelora_core import DEFAULT_POLICY
from moelora_core.graphs import GraphPool
from moelora_core.graphs.triton_launches import evaluate_grid

pytestmark = [
    pytest.mark.cudagraph,
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU"),
]

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("graph_triton_kernels")

C, H = 8, 5  # H not a power of two: the column mask matters


def _values(rows, seed):
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))


def _expected(x, y, live):
    out = torch.zeros(C, H)
    out[:live] = x[:live] + y[:live]
    return out


def test_device_count_kernel_replays_new_static_inputs():
    x, y = torch.zeros(C, H), torch.zeros(C, H)
    count = torch.zeros(1, dtype=torch.int32)

    def forward():
        out = torch.full((C, H), float("nan"), device=x.device)  # poisoned: every row must be written
        return kernels.add_rows(x, y, out, count=count)

    graph = GraphPool("prefill", "cpu").capture(forward, warmup=0)
    assert graph.num_launches == 1
    for step, live in enumerate((8, 3, 6, 1)):  # small after large: nothing stale may remain
        x.copy_(_values(C, 2 * step)), y.copy_(_values(C, 2 * step + 1))
        count.fill_(live)
        out = graph.replay()
        DEFAULT_POLICY.assert_close(out[:live], (x + y)[:live], dtype=torch.float32, what=f"live rows, step {step}")
        assert torch.equal(out[live:], torch.zeros(C - live, H)), f"stale rows at step {step}"


def test_host_count_launch_freezes_its_grid_and_count():
    x, y = _values(C, 10), _values(C, 11)
    state = {"n": 6}
    graph = GraphPool("prefill", "cpu").capture(
        lambda: kernels.add_rows(x, y, torch.zeros(C, H, device=x.device), n_rows=state["n"]), warmup=0
    )
    state["n"] = 2
    out = graph.replay()
    assert torch.equal(out, _expected(x, y, 6))  # computed with the capture-time n = 6


def test_interpreter_ops_are_not_recorded_and_interception_is_removed():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    runs = (InterpretedFunction.run, JITFunction.run)
    x, y = _values(C, 12), _values(C, 13)
    count = torch.tensor([C], dtype=torch.int32)
    graph = GraphPool("decode", "cpu").capture(
        lambda: kernels.add_rows(x, y.contiguous(), torch.zeros(C, H, device=x.device), count=count), warmup=0
    )
    # zeros (the output) is the one recorded op: y.contiguous() is y itself, a view; the
    # interpreter's own copies to and from "host" are not recorded.
    assert (graph.num_ops, graph.num_launches) == (1, 1)
    assert (InterpretedFunction.run, JITFunction.run) == runs
    DEFAULT_POLICY.assert_close(graph.replay(), x + y, dtype=torch.float32, what="full batch")


def test_callable_grid_is_evaluated_with_the_meta_parameters():
    kernel = kernels._add_rows_kernel
    args = (None, None, None, None, 6, C, H)
    grid = evaluate_grid(kernel, lambda meta: (triton.cdiv(meta["n_rows"], meta["ROWS"]), 1), args,
                         {"ROWS": 4, "BLOCK": 8, "USE_COUNT": False, "num_warps": 2})
    assert grid == (2, 1)
    with pytest.raises(ValueError, match="at most 3 axes"):
        evaluate_grid(kernel, (1, 1, 1, 1), args, {})
