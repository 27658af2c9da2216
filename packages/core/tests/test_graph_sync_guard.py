"""host_sync_guard on the CPU: the same host syncs as CUDA's sync debug mode fail; host lists and
pinned staging pass.

Covers: host reads of device data (.item(), .tolist(), .cpu(), bool(), int(), printing,
torch.equal), data-dependent shapes (nonzero, x[mask]), blocking host-to-device copies
(StaticBuffer.write without staging, a host tensor made with device=... read by a device op without a
copy); what passes: host lists and tensors built from them, PinnedStaging + StaticBuffer.write(stage=...),
non-blocking copies (the production idiom ``torch.tensor(lst, device="cpu").to(device, non_blocking=True)``),
x[mask] = scalar; device data derived inside the guard is device data; the guard is gone after
the block, also after an error.
"""

import pytest
import torch

from moelora_core import HostSyncError, PinnedStaging, StaticBuffer
from moelora_core.graphs import host_sync_guard

pytestmark = pytest.mark.cudagraph


def _metadata():
    seg_indptr = torch.tensor([0, 3, 5, 9], dtype=torch.int32)  # built before the guard: device data
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))
    return seg_indptr, x


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("item", r"Tensor\.item\(\)"),
        ("tolist", r"Tensor\.tolist\(\)"),
        ("cpu", r"Tensor\.cpu\(\)"),
        ("bool", r"Tensor\.bool\(\)"),
        ("int", r"Tensor\.int\(\)"),
        ("print", r"Tensor\.format\(\)|Tensor\.str\(\)|Tensor\.repr\(\)"),
        ("equal", "equal"),
        ("derived_item", r"Tensor\.item\(\)"),  # device data derived inside the guard
        ("nonzero", "nonzero"),
        ("mask_index", "boolean mask"),
        ("static_write_unstaged", "blocking"),
        ("list_on_device_read", "host tensor"),  # torch.tensor(lst, device=dev) used with no copy
        ("blocking_to", "blocking"),
    ],
)
def test_host_syncs_fail(case, match):
    seg_indptr, x = _metadata()
    buf = StaticBuffer("weight_indices", 8, dtype=torch.int32, device="cpu", fill=-1)
    cases = {
        "item": lambda: seg_indptr[-1].item(),
        "tolist": lambda: seg_indptr.tolist(),
        "cpu": lambda: seg_indptr.cpu(),
        "bool": lambda: bool(seg_indptr[1] > 2),
        "int": lambda: x[: int(seg_indptr[1])],
        "print": lambda: f"{seg_indptr}",
        "equal": lambda: torch.equal(seg_indptr, seg_indptr),
        "derived_item": lambda: (seg_indptr[1:] - seg_indptr[:-1]).max().item(),
        "nonzero": lambda: torch.nonzero(seg_indptr),
        "mask_index": lambda: x[x > 0],
        "static_write_unstaged": lambda: buf.write([1, 2, 3]),
        "list_on_device_read": lambda: seg_indptr[:3] + torch.tensor([1, 2, 3], dtype=torch.int32, device="cpu"),
        "blocking_to": lambda: torch.tensor([1, 2]).to("cpu"),
    }
    with pytest.raises(HostSyncError, match=match), host_sync_guard("cpu"):
        cases[case]()


def test_host_lists_and_pinned_staging_pass():
    seg_indptr, x = _metadata()
    staging = PinnedStaging(32, torch.int32, "cpu")
    buf = StaticBuffer("weight_indices", 8, dtype=torch.int32, device="cpu", fill=-1)
    host_lens = [3, 2, 4]
    with host_sync_guard("cpu"):
        lens = torch.tensor(host_lens)  # host data: reading it back is not a sync
        assert lens.tolist() == host_lens and int(lens.sum()) == 9
        with staging.batch() as stage:
            buf.write([2, 0, 1], stage=stage)  # pinned staging, non_blocking copy
        dev_lens = torch.tensor(host_lens, dtype=torch.int32).to("cpu", non_blocking=True)
        # the production idiom: a host tensor spelled device="cpu" (pinned where CUDA is), then a
        # non-blocking copy; on CUDA that is an asynchronous copy, so it must pass here too
        pinned = torch.cuda.is_available()
        idiom = torch.tensor(host_lens, dtype=torch.int32, device="cpu", pin_memory=pinned).to(
            "cpu", non_blocking=True)
        y = x.clone()
        y[y > 1.0] = 0.0  # masked_fill: no sync
        seg_lens = seg_indptr[1:] - seg_indptr[:-1]
        ok = torch.where(seg_lens == dev_lens, 1, 0)
    assert buf.tensor.tolist() == [2, 0, 1, -1, -1, -1, -1, -1]
    assert ok.tolist() == [1, 1, 1] and (y <= 1.0).all()
    assert idiom.tolist() == host_lens


def test_guard_is_removed_after_the_block_even_after_an_error():
    seg_indptr, _ = _metadata()
    with pytest.raises(HostSyncError), host_sync_guard("cpu"):
        seg_indptr.sum().item()
    assert seg_indptr.sum().item() == 17


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_guard_uses_sync_debug_mode_and_restores_it():
    x = torch.arange(4, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(HostSyncError, match="synchronizing"), host_sync_guard("cuda"):
        x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == before
    staging = PinnedStaging(8, torch.int32, "cuda")
    buf = StaticBuffer("w", 4, dtype=torch.int32, device="cuda", fill=-1)
    with host_sync_guard("cuda"), staging.batch() as stage:
        buf.write([1, 2], stage=stage)
    assert buf.tensor.tolist() == [1, 2, -1, -1]


def test_marked_host_memory_is_host_through_views_and_forgotten_when_freed():
    import gc

    from moelora_core.graphs import mark_host_memory
    from moelora_core.graphs.host_memory import is_marked_host_memory

    buf = mark_host_memory(torch.zeros(8, dtype=torch.int32))
    view = buf[2:5]
    del buf
    gc.collect()
    assert is_marked_host_memory(view)  # the storage is alive through the view
    with host_sync_guard("cpu"):
        assert view.tolist() == [0, 0, 0]  # host memory: reading it is not a sync
    del view
    gc.collect()
    other = torch.zeros(8, dtype=torch.int32)  # may reuse the address: must not inherit the mark
    assert not is_marked_host_memory(other)
    with pytest.raises(TypeError, match="CPU tensor"):
        mark_host_memory(torch.zeros(2, device="meta"))


def _reads_back(t):
    return t.sum().item()  # the call site the error must name


def test_host_sync_error_names_its_call_site():
    """A sync deep in a backend's code is found from the error alone: the message names the innermost
    frame outside PyTorch and the guard (file, line, function)."""
    seg_indptr, _ = _metadata()
    with pytest.raises(HostSyncError, match=r"test_graph_sync_guard\.py:\d+ in _reads_back"), host_sync_guard("cpu"):
        _reads_back(seg_indptr)
