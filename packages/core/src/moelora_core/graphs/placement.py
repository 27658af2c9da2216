"""Which tensors are device data and which are host data, inside a guarded or captured region.

On CUDA the answer is the tensor's device: CUDA tensors are device data, CPU tensors host data.
On a CPU-only run every tensor lives on the CPU, so the emulator and the host-sync guard apply
the rules a CUDA program would make true (documented in ``packages/core/docs/graphs.md``):

- **Device data**: every tensor that existed before the region began (activations, weights,
  static graph buffers, metadata) unless registered as host memory; tensors made by a factory
  called with ``device=`` (or ``*_like`` / ``new_*`` of device data); every result of an op that
  reads device data.
- **Host data**: tensors made inside the region from Python data (``torch.tensor``,
  ``as_tensor``, ``asarray``, ``from_numpy``, ``frombuffer``) or by a factory called without
  ``device=`` (on CUDA both give CPU tensors), results of ops that read host data only, and host
  memory registered with :func:`~moelora_core.graphs.host_memory.mark_host_memory` (the CPU twin
  of pinned memory: ``PinnedStaging`` registers its buffers).

A tensor's placement is a property of its storage: a view of host data is host data.
"""

from __future__ import annotations

import torch

from moelora_core.graphs.host_memory import is_marked_host_memory, is_pinned_host


class Placement:
    """Host/device classification for one region on ``device``.

    Args:
        device: the device the program computes on ("cpu" for the emulator without CUDA).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.by_device_type = self.device.type != "cpu"
        # storage data_ptr -> storage, for host data created inside the region (CPU runs only).
        # The storage is held so its address cannot be reused by device data while the region lasts.
        self._host: dict[int, torch.UntypedStorage] = {}

    def is_host(self, t: torch.Tensor) -> bool:
        """True if ``t`` is host data (see the module docstring)."""
        if self.by_device_type:
            return t.device.type == "cpu"
        if t.device.type != "cpu":  # e.g. a meta tensor: never host data
            return False
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0:  # zero-size storage: nothing to read or sync on
            return True
        return ptr in self._host or is_marked_host_memory(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """True for host data a graph may copy from asynchronously (pinned or registered)."""
        return self.is_host(t) and is_pinned_host(t)

    def tag_host(self, t: torch.Tensor) -> None:
        """Record ``t``'s storage as host data (CPU runs; a no-op when the device type decides)."""
        if self.by_device_type or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        if storage.data_ptr():
            self._host[storage.data_ptr()] = storage
