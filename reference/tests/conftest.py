"""Helpers shared by the reference tests: a host-sync guard and the layer harness.

The guard is a small, local stand-in for the graph emulator's rules (DESIGN.md §3, §6): during a
delta call nothing may read device data on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)``, ...), build a tensor from host data, or run an op whose output shape depends on
device values (``nonzero``, ``masked_select``, ``unique``, ``x[mask]``, ...).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moelora_core import HostSyncError
from moelora_core.moe_deltas import BackendMoEDeltas
from moelora_reference import base_moe

aten = torch.ops.aten
_SYNC_METHODS = {getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__",
                                                    "__float__", "__index__")}
_CREATORS = {torch.tensor, torch.as_tensor, torch.from_numpy}
_DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive, aten.bincount,
                   aten._local_scalar_dense, aten.unique_dim, aten.argwhere}


class _FunctionGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_METHODS:
            raise HostSyncError(f"host read of device data: Tensor.{func.__name__}")
        if func in _CREATORS:
            raise HostSyncError(f"tensor built from host data: torch.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _DispatchGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _DATA_DEPENDENT:
            raise HostSyncError(f"{func} has a data-dependent output shape or reads device data")
        if func.overloadpacket in (aten.index, aten.index_put_, aten.index_put) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())
        ):
            raise HostSyncError(f"{func} with a boolean mask")
        if func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None:
            raise HostSyncError("repeat_interleave without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync():
    """Raise ``HostSyncError`` on any host synchronisation or data-dependent shape inside."""
    with _FunctionGuard(), _DispatchGuard():
        yield


@pytest.fixture
def guard():
    return no_host_sync


def run_layer(backend, m, info, x, topk_ids, topk_weights, *, lora=True):
    """The suite's layer harness: the torch base path with the backend's deltas, intermediates in
    fp32 (only y is rounded to x's dtype)."""
    deltas = BackendMoEDeltas(backend, m.lora, info) if lora else None
    return base_moe.moe_forward(x, topk_ids, topk_weights, m.base, deltas=deltas)


@pytest.fixture
def layer():
    return run_layer
