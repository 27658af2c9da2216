"""The host-sync guard for eager forwards (DESIGN.md §3: no host<->device sync in prepare + forward).

On CUDA it is ``torch.cuda.set_sync_debug_mode("error")`` for the body (the previous mode is
restored after); PyTorch then raises on every synchronising call, which the guard re-raises as
:class:`~moelora_core.errors.HostSyncError`. On a CPU device it applies the same rules through
the interceptor (:mod:`.interception`, :mod:`.sync_rules`): ``.item()``, ``.tolist()``,
``.cpu()``, ``bool()``, ``int()`` of device data, data-dependent shapes (``nonzero``, ``x[mask]``)
and blocking host-to-device copies raise; host lists and pinned staging do not.

What is device data on a CPU run is decided by :class:`~.placement.Placement`: tensors that
existed before the guard (inputs, weights, static buffers, metadata) and everything computed from
them; what is host data: tensors the body builds from Python data, and registered host memory
(``PinnedStaging`` buffers). So a backend that stages host lists through ``PinnedStaging`` and
copies with ``non_blocking=True`` passes, and ``info.seg_indptr[-1].item()`` fails.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from moelora_core.errors import HostSyncError
from moelora_core.graphs.interception import Interceptor, call_site
from moelora_core.graphs.triton_launches import intercept_triton_launches

_CUDA_SYNC_ERROR = "called a synchronizing CUDA operation"


@contextmanager
def host_sync_guard(device: torch.device | str) -> Iterator[None]:
    """Fail on any host<->device synchronisation in the body.

    Args:
        device: the device the guarded forward computes on ("cuda" / "cuda:N" / "cpu").

    Raises:
        HostSyncError: at the first synchronising call, naming it (CPU) or wrapping PyTorch's
            error (CUDA).
    """
    device = torch.device(device)
    if device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        except RuntimeError as exc:
            if _CUDA_SYNC_ERROR in str(exc) and not isinstance(exc, HostSyncError):
                site = call_site(traceback.extract_tb(exc.__traceback__))
                raise HostSyncError(f"host sync inside host_sync_guard on {device} at {site}: {exc}") from exc
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    interceptor = Interceptor(device, where="inside host_sync_guard", capture=False)

    def launch(kernel, run, args, kwargs, grid):
        # A kernel launch is no host sync. Under TRITON_INTERPRET=1 the interpreter copies each
        # argument's storage back after the kernel (``UntypedStorage.copy_``, dispatched on
        # zero-size views set onto the storages): checked here, those copies would mark the
        # arguments' storages as host data, and the next device op on them would fail.
        with interceptor.paused():
            return run(kernel, *args, grid=grid, warmup=False, **kwargs)

    with interceptor.active(), intercept_triton_launches(launch):
        yield
