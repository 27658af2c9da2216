"""The emulator's CUDA-graph semantics, one rule per test (CPU).

Covers: capture leaves no work done (pre-existing state restored, captured storage poisoned until
the first replay, also after a failed capture); ``empty`` storage is not rewritten; binding by
storage (rebinding a name or ``set_`` after capture); in-place writes through views and ``out=``
into a view hit the same storage on replay; tuple outputs; RNG (fresh draws per replay, capture
draws nothing); host scalars and 0-dim host tensors frozen; ``t[i] = number`` a device fill (an index list a host
tensor); ops recorded under inference mode replay under it; pinned host memory re-read on every
replay; pageable and blocking copies, data-dependent shapes and host reads raise at capture;
host data may be read on the host during capture; modes are gone after capture.
"""

import pytest
import torch

from moelora_core import HostSyncError
from moelora_core.graphs import GraphPool, mark_host_memory, pin_host_memory

pytestmark = pytest.mark.cudagraph


def _pool():
    return GraphPool("decode", "cpu")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_capture_does_not_leave_its_work_done():
    x = _rand(4)
    steps = torch.zeros(1, dtype=torch.int64)

    def forward():
        steps.add_(1)  # a pre-existing buffer written in place
        return x * 2

    graph = _pool().capture(forward, warmup=1)
    assert steps.item() == 1  # the warm-up ran; the capture did not
    assert torch.isnan(graph.output).all()  # captured storage: poisoned until the first replay
    graph.replay()
    graph.replay()
    assert steps.item() == 3
    assert torch.equal(graph.output, x * 2)


def test_integer_captured_storage_is_poisoned_with_the_dtype_minimum():
    ids = torch.tensor([3, 1, 2], dtype=torch.int32)
    graph = _pool().capture(lambda: ids + 1, warmup=0)
    assert (graph.output == torch.iinfo(torch.int32).min).all()
    assert graph.replay().tolist() == [4, 2, 3]


def test_failed_capture_restores_pre_existing_state_and_raises():
    steps = torch.zeros(1)

    def forward():
        steps.add_(1)
        return int(steps.item())

    with pytest.raises(HostSyncError, match=r"Tensor\.item\(\)"):
        _pool().capture(forward, warmup=0)
    assert steps.item() == 0


def test_factories_without_device_make_host_data_as_on_cuda():
    x = _rand(4)
    with pytest.raises(HostSyncError, match="host tensor of shape"):
        _pool().capture(lambda: x + torch.rand(4), warmup=0)  # on CUDA: a CPU tensor


def test_empty_is_not_rewritten_on_replay():
    x = _rand(4)

    def forward():
        buf = torch.empty(4, device=x.device)
        buf[:2] = x[:2]  # the tail of buf is never written: on CUDA it holds garbage
        return buf

    graph = _pool().capture(forward, warmup=0)
    out = graph.replay()
    assert torch.equal(out[:2], x[:2]) and torch.isnan(out[2:]).all()


def test_rebinding_or_set_after_capture_does_not_change_what_replay_reads():
    x = _rand(3, seed=2)
    state = {"w": _rand(3, seed=1)}
    graph = _pool().capture(lambda: x * state["w"], warmup=0)
    x_before, w_before = x.clone(), state["w"].clone()
    state["w"] = _rand(3, seed=3)  # rebinding the name
    x.set_(_rand(3, seed=4))  # repointing the tensor object at new storage
    assert torch.equal(graph.replay(), x_before * w_before)


def test_in_place_through_views_and_out_into_views_hit_the_same_storage():
    x = _rand(4, 3, seed=5)
    out = torch.zeros(4, 6)

    def forward():
        left, right = out.split(3, dim=1)
        torch.mul(x, 2.0, out=left)
        right.copy_(x)
        out.view(4, 2, 3)[:, 1].add_(1.0)
        out[:, 0].mul_(-1.0)
        return out

    graph = _pool().capture(forward, warmup=0)
    assert torch.equal(out, torch.zeros(4, 6))  # restored after capture
    x.copy_(_rand(4, 3, seed=6))
    graph.replay()
    expected = torch.cat([x * 2.0, x + 1.0], dim=1)
    expected[:, 0] *= -1.0
    assert torch.equal(out, expected)


def test_tuple_outputs_are_written_back():
    x = _rand(5, 4, seed=7)
    graph = _pool().capture(lambda: torch.topk(x, 2, dim=1), warmup=0)
    x.copy_(_rand(5, 4, seed=8))
    values, indices = graph.replay()
    expected = torch.topk(x, 2, dim=1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_random_ops_draw_like_eager_and_capture_draws_nothing():
    x = _rand(6)

    def forward():
        return x + torch.rand(6, device=x.device)

    torch.manual_seed(123)
    graph = _pool().capture(forward, warmup=0)
    after_capture = torch.rand(6)
    torch.manual_seed(123)
    assert torch.equal(after_capture, torch.rand(6))  # the capture consumed nothing
    torch.manual_seed(9)
    first, second = graph.replay().clone(), graph.replay().clone()
    torch.manual_seed(9)
    assert torch.equal(first, forward()) and torch.equal(second, forward())


def test_python_scalars_and_host_zero_dim_tensors_are_frozen():
    x = _rand(3)
    state = {"gain": 2.0}
    graph = _pool().capture(lambda: x * state["gain"] + torch.tensor(state["gain"]), warmup=0)
    state["gain"] = 5.0
    assert torch.equal(graph.replay(), x * 2.0 + 2.0)


def test_python_number_written_by_index_is_a_device_fill_and_a_host_list_index_is_refused():
    # Regression (SGLang's virtual-experts align, ``real_block_counts[sentinel] = 0``): PyTorch makes
    # the number on the target's device (a fill on CUDA), so it is no host-to-device copy; an index
    # list still is one.
    src = _rand(4)
    buf = torch.zeros(4)

    def forward():
        buf.copy_(src)
        buf[2] = 0.0
        buf[0:1] = 7.0
        return buf * 2

    graph = _pool().capture(forward, warmup=0)
    src.copy_(_rand(4, seed=1))
    want = _rand(4, seed=1)
    want[2], want[0] = 0.0, 7.0
    assert torch.equal(graph.replay(), want * 2)
    with pytest.raises(HostSyncError, match="host tensor"):
        _pool().capture(lambda: buf.__setitem__([1, 2], 0.0), warmup=0)


def test_ops_recorded_under_inference_mode_replay_under_it():
    # Regression (vLLM's LoRA ops enter torch.inference_mode themselves): their tensors are
    # inference tensors, which an in-place replay outside inference mode would refuse.
    x = _rand(4)

    def forward():
        with torch.inference_mode():
            y = x * 2
            y.add_(1.0)
        return y

    graph = _pool().capture(forward, warmup=0)
    x.copy_(_rand(4, seed=3))
    assert torch.equal(graph.replay(), _rand(4, seed=3) * 2 + 1.0)


def test_pinned_host_memory_is_reread_on_every_replay():
    host = pin_host_memory(torch.zeros(3))
    dev = torch.zeros(3)

    def forward():
        dev.copy_(host, non_blocking=True)
        return dev * 10

    graph = _pool().capture(forward, warmup=0)
    host.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert graph.replay().tolist() == [10.0, 20.0, 30.0]
    host.copy_(torch.tensor([4.0, 5.0, 6.0]))
    assert graph.replay().tolist() == [40.0, 50.0, 60.0]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("pageable_copy", "pageable host memory"),  # non_blocking from a list-built tensor
        ("blocking_pinned_copy", "blocking"),
        ("list_on_device_read", "host tensor"),  # torch.tensor(list, device=...) read with no copy
        ("host_tensor_to_device", "pageable host memory"),  # torch.tensor(list).to(device)
        ("tolist", r"Tensor\.tolist\(\)"),
        ("cpu", r"Tensor\.cpu\(\)"),
        ("bool", r"Tensor\.bool\(\)"),
        ("int_slice", r"Tensor\.index\(\)|Tensor\.int\(\)|host read"),
        ("repr", r"Tensor\.repr\(\)"),
        ("nonzero", "nonzero"),
        ("masked_select", "masked_select"),
        ("unique", "unique"),
        ("bincount", "bincount"),
        ("repeat_interleave", "repeat_interleave"),
        ("mask_index", "boolean mask"),
        ("mask_put_tensor", "boolean mask"),
        ("equal", "equal"),
        ("host_tensor_in_device_op", "host tensor of shape"),
    ],
)
def test_host_syncs_raise_at_capture(case, match):
    x = _rand(4, seed=10)
    ids = torch.tensor([1, 0, 2, 1])
    pinned = mark_host_memory(torch.zeros(4))
    cases = {
        "pageable_copy": lambda: x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]), non_blocking=True),
        "blocking_pinned_copy": lambda: x.copy_(pinned),
        "list_on_device_read": lambda: x[:2] + torch.tensor([1.0, 2.0], device="cpu"),
        "host_tensor_to_device": lambda: torch.tensor([1, 2]).to("cpu", non_blocking=True),
        "tolist": lambda: x.tolist(),
        "cpu": lambda: x.cpu(),
        "bool": lambda: bool(x[0] > 0),
        "int_slice": lambda: x[: ids[0]],
        "repr": lambda: repr(x),
        "nonzero": lambda: torch.nonzero(x > 0),
        "masked_select": lambda: torch.masked_select(x, x > 0),
        "unique": lambda: torch.unique(ids),
        "bincount": lambda: torch.bincount(ids),
        "repeat_interleave": lambda: torch.repeat_interleave(ids),
        "mask_index": lambda: x[x > 0],
        "mask_put_tensor": lambda: x.__setitem__(x > 0, x[:1]),
        "equal": lambda: torch.equal(x, x),
        "host_tensor_in_device_op": lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0]),
    }
    before = x.clone()
    with pytest.raises(HostSyncError, match=match):
        _pool().capture(cases[case], warmup=0)
    assert torch.equal(x, before)  # nothing left changed


def test_what_cuda_allows_during_capture_records_fine():
    x = _rand(4, seed=12)
    host_rows = [3, 0, 1]

    def forward():
        # host data read on the host: not a sync (CPU work, done once at capture)
        n = len(torch.tensor(host_rows).tolist())
        y = x.clone()
        y[y > 0.5] = 0.0  # x[mask] = host scalar is a masked_fill: no sync
        return y[:n] * torch.tensor(2.0)

    graph = _pool().capture(forward, warmup=0)
    x.copy_(_rand(4, seed=13))
    expected = x.clone()
    expected[expected > 0.5] = 0.0
    assert torch.equal(graph.replay(), expected[:3] * 2.0)


def test_interception_ends_with_the_capture():
    x = torch.tensor([1.5])
    _pool().capture(lambda: x * 2, warmup=0)
    assert x.item() == 1.5 and x.tolist() == [1.5]


def test_replay_sees_new_values_of_static_inputs_and_counts_its_ops():
    x, w = _rand(4, 3, seed=14), _rand(3, 2, seed=15)
    graph = _pool().capture(lambda: torch.relu(x @ w) + 1, warmup=0)
    assert graph.kind == "emulated" and graph.num_ops == 3 and graph.num_launches == 0
    for seed in (16, 17):
        x.copy_(_rand(4, 3, seed=seed))
        assert torch.equal(graph.replay(), torch.relu(x @ w) + 1)


def test_a_replay_inside_another_capture_is_recorded_there():
    # like a child graph: the outer graph re-issues the inner graph's work
    x = _rand(3, seed=18)
    pool = _pool()
    inner = pool.capture(lambda: x * 2, warmup=0)
    outer = pool.capture(lambda: inner.replay() + 1, warmup=0)
    x.copy_(_rand(3, seed=19))
    assert torch.equal(outer.replay(), x * 2 + 1)
