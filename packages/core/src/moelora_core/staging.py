"""Pinned, double-buffered host→device staging for host lists (DESIGN.md §3).

Backends build metadata as Python lists on the host. Copying them with ``torch.tensor(list,
device="cuda")`` is a blocking copy from pageable memory; instead they are written into a pinned
host buffer and copied with ``non_blocking=True``. Two host buffers alternate, and each records a
CUDA event after its copies: before a buffer is rewritten, the host waits for *that buffer's*
previous copies (issued two batches ago, in practice long finished), so a copy never overwrites
staging the device is still reading. No device value is ever read back.

On a CPU device there is no pinned memory and copies are synchronous; the same code runs with
plain host tensors. The buffers are normal (not inference) tensors wherever they are built, so a
staging made inside ``torch.inference_mode()`` serves later batches outside it and vice versa.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.graphs.host_memory import mark_host_memory


class PinnedStaging:
    """Two pinned host buffers of ``capacity`` elements of ``dtype``, used alternately.

    Args:
        capacity: elements one batch may stage in total (all its ``copy`` calls together).
        dtype: element dtype (int32 for metadata, float32 for σ).
        device: destination device.

    Use::

        with staging.batch() as stage:
            stage.copy(host_list, dst_tensor)    # dst.numel() elements; list padded by caller
    """

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.capacity = int(capacity)
        pin = self.device.type == "cuda"
        # Normal tensors even when built inside torch.inference_mode(): every later batch writes
        # them in place, and an inference tensor refuses in-place writes outside inference mode.
        with torch.inference_mode(False):
            self._host = [torch.empty(self.capacity, dtype=dtype, pin_memory=pin) for _ in range(2)]
        for host in self._host:
            # The CPU twin of pinned memory: the graph emulator and the host-sync guard treat
            # copies from these buffers as pinned staging, not as device data.
            mark_host_memory(host)
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._current = 1

    @contextmanager
    def batch(self) -> Iterator[_StagingWriter]:
        """Switch to the other host buffer for one batch's copies; record its event on exit."""
        self._current ^= 1
        event = self._events[self._current]
        if event is not None and not event.query():
            # The copies from this buffer two batches ago are still in flight: wait for them (a
            # host wait on our own copy, not a read of device data).
            event.synchronize()
        writer = _StagingWriter(self._host[self._current], self.device)
        yield writer
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._events[self._current] = ev


class _StagingWriter:
    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self._host = host
        self._device = device
        self._offset = 0

    def copy(self, values: Sequence[int] | Sequence[float], dst: torch.Tensor) -> None:
        """Stage ``values`` (exactly ``dst.numel()`` of them) and copy them into ``dst`` in place.

        Raises:
            InvalidFieldError: length mismatch, dtype mismatch, or the batch's staging capacity
                is exhausted (nothing is copied).
        """
        n = dst.numel()
        if len(values) != n:
            raise InvalidFieldError("staging", f"{len(values)} values for a destination of {n} elements")
        if dst.dtype != self._host.dtype:
            raise InvalidFieldError("staging", f"destination dtype {dst.dtype} != staging dtype {self._host.dtype}")
        if self._offset + n > self._host.numel():
            raise InvalidFieldError(
                "staging", f"batch needs {self._offset + n} elements, staging capacity is {self._host.numel()}"
            )
        if n == 0:
            return
        region = self._host[self._offset : self._offset + n]
        region.copy_(torch.as_tensor(values, dtype=self._host.dtype))
        dst.view(-1).copy_(region, non_blocking=True)
        self._offset += n
