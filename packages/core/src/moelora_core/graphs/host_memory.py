"""Host memory that device work may read during a graph: the CPU twin of pinned memory.

On CUDA, a graph may copy from (or into) host memory only if it is pinned: the copy is captured
as a memcpy node that re-reads the host buffer on every replay, and PyTorch refuses copies from
pageable memory during capture. A CPU-only run has no pinned memory, so the emulator and the
host-sync guard need to be told which host buffers play that role: :func:`mark_host_memory`
registers them (``PinnedStaging`` registers its two buffers), and :func:`pin_host_memory` is the
device-neutral spelling of ``tensor.pin_memory()``.

The registry holds weak references to the storages: a marked buffer that is freed (with all its
views) drops out by itself.
"""

from __future__ import annotations

import weakref

import torch

# storage data_ptr -> weak reference to the storage (alive while any tensor or view holds it).
_MARKED: dict[int, weakref.ref] = {}


def mark_host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """Register ``tensor``'s storage as host staging memory (pinned, on CUDA) and return it.

    Args:
        tensor: a CPU tensor of any dtype and shape.

    Raises:
        TypeError: ``tensor`` is not a CPU tensor (device memory is never host memory).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise TypeError(f"mark_host_memory expects a CPU tensor, got {type(tensor).__name__} "
                        f"on {getattr(tensor, 'device', '?')}")
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key:
        _MARKED[key] = weakref.ref(storage, lambda ref, key=key: _forget(key, ref))
    return tensor


def _forget(key: int, ref: weakref.ref) -> None:
    if _MARKED.get(key) is ref:
        del _MARKED[key]


def is_marked_host_memory(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` views a storage registered with :func:`mark_host_memory`."""
    if tensor.device.type != "cpu":
        return False
    ref = _MARKED.get(tensor.untyped_storage().data_ptr())
    return ref is not None and ref() is not None


def pin_host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.pin_memory()`` where CUDA is available, else ``tensor`` itself; registered either way.

    The device-neutral way to allocate a host buffer that graphs may copy from: on a CUDA machine
    it is page-locked, on a CPU-only machine the emulator and the guard treat it as pinned.

    Raises:
        TypeError: ``tensor`` is not a CPU tensor.
    """
    if tensor.device.type == "cpu" and torch.cuda.is_available():
        tensor = tensor.pin_memory()
    return mark_host_memory(tensor)


def is_pinned_host(tensor: torch.Tensor) -> bool:
    """True for host memory a graph may copy from: CUDA-pinned or registered."""
    if tensor.device.type != "cpu":
        return False
    if is_marked_host_memory(tensor):
        return True
    return torch.cuda.is_available() and tensor.is_pinned()
