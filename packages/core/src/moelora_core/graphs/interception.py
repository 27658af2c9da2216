"""The torch-level interception shared by the host-sync guard and the graph emulator.

Two PyTorch modes see everything a program does with tensors:

- a ``TorchFunctionMode`` sees Python-level calls: the host reads (``.item()``, ``.tolist()``,
  ``.cpu()``, ``bool()``...) that do not always reach the dispatcher, and tensor creation, where
  the ``device=`` argument tells host data from device data on a CPU-only run;
- a ``TorchDispatchMode`` sees every aten op with its real arguments: data-dependent shapes,
  host<->device copies, host tensors read by device ops, and (for the emulator) every device op
  to record.

:class:`Interceptor` applies :mod:`.sync_rules` with a :class:`~.placement.Placement`; the
emulator's recorder subclasses it and overrides :meth:`Interceptor.before_device_op` and
:meth:`Interceptor.after_device_op`. Ops issued by the interceptor itself, and by a Triton
launch (the interpreter runs its own torch ops), run under :meth:`Interceptor.paused`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moelora_core.errors import HostSyncError
from moelora_core.graphs import sync_rules
from moelora_core.graphs.placement import Placement

aten = torch.ops.aten

_HOST_VALUE_OPS = frozenset(getattr(aten, n) for n in ("equal", "is_nonzero") if hasattr(aten, n))

_HINTS = {
    "read": "keep live counts on the device (static buffers, masks) or take them from host lists",
    "shape": "use a fixed-capacity form (a mask with torch.where, padded indices, nonzero_static)",
    "pageable": "CUDA refuses copies between pageable host memory and the device during capture; write "
                "static buffers before replay, or copy from pinned memory (PinnedStaging, pin_host_memory) "
                "with non_blocking=True",
    "blocking": "a blocking host<->device copy waits for the device; stage host lists through "
                "PinnedStaging and copy with non_blocking=True",
    "mixed": "on CUDA this is a device mismatch or an implicit blocking copy (torch.tensor(host list, "
             "device=cuda) is one); build the tensor on the host and copy it with .to(device, non_blocking=True), "
             "or stage it through PinnedStaging",
}


#: Frames that are never a sync's call site: PyTorch, the interception itself, the standard library.
_NOT_CALL_SITES = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(os.__file__))


def call_site(frames: list[traceback.FrameSummary] | None = None) -> str:
    """``file:line in function`` of the innermost frame of ``frames`` (default: the current stack)
    outside PyTorch, the graphs package and the standard library: the code that synchronised, which a
    ``HostSyncError`` names (a sync that happens only in the first step after a slot load is otherwise
    hard to find). "unknown" when every frame is one of those."""
    frames = traceback.extract_stack() if frames is None else frames
    for frame in reversed(frames):
        name = frame.filename
        installed = "site-packages" in name and not name.startswith(_NOT_CALL_SITES[:2])  # not the stdlib's
        if installed or not name.startswith(_NOT_CALL_SITES):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown"


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class Interceptor:
    """Host-sync checks (and, in subclasses, recording) for one region on ``device``.

    Args:
        device: the device the program computes on.
        where: how error messages name the region ("inside host_sync_guard", "during graph capture").
        capture: apply capture rules (copies need pinned host memory) rather than eager rules.
    """

    def __init__(self, device: torch.device | str, *, where: str, capture: bool) -> None:
        self.placement = Placement(device)
        self.where = where
        self.capture = capture
        self._bypass = 0
        self._override: str | None = None

    # -- region control -------------------------------------------------------------------
    @contextmanager
    def active(self) -> Iterator[Interceptor]:
        """Install both modes for the ``with`` body."""
        with _FunctionHook(self), _DispatchHook(self):
            yield self

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Let ops through unchecked and unrecorded (the interceptor's own work, Triton launches)."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    @contextmanager
    def placing(self, placement: str | None) -> Iterator[None]:
        """Ops without tensor inputs inside the body create ``placement`` ("host" / "device") data."""
        previous, self._override = self._override, placement
        try:
            yield
        finally:
            self._override = previous

    def violation(self, what: str, kind: str) -> NoReturn:
        """Raise :class:`HostSyncError` for ``what`` with the hint for ``kind`` and the call site."""
        raise HostSyncError(f"{what} {self.where} at {call_site()}: {_HINTS[kind]}")

    # -- hooks for subclasses ----------------------------------------------------------------
    def before_device_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        """Called before a device op runs (after the checks passed)."""

    def after_device_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> None:
        """Called after a device op ran."""

    # -- rules -------------------------------------------------------------------------------
    def is_device_target(self, device: object) -> bool:
        """Whether an explicit ``device=`` names device memory (on a CPU run: always)."""
        if not self.placement.by_device_type:
            return True
        return torch.device(device).type != "cpu"

    def crossing(self, direction: str, pinned: bool, non_blocking: bool, what: str) -> None:
        """Check a host<->device copy ("h2d" / "d2h") against the region's rules."""
        if self.capture and not pinned:
            self.violation(f"{what} ({direction}, pageable host memory)", "pageable")
        if not non_blocking:
            self.violation(f"{what} ({direction}, blocking)", "blocking")

    def function_call(self, func, args: tuple, kwargs: dict):
        name = sync_rules.SYNC_METHODS.get(func)
        if name is not None:
            t = args[0] if args else None
            if isinstance(t, torch.Tensor) and not self.placement.is_host(t):
                self.violation(f"Tensor.{name.strip('_')}() of device data {tuple(t.shape)}", "read")
            return func(*args, **kwargs)
        if func is torch.Tensor.__setitem__ and sync_rules.is_scalar_setitem(args, self.placement):
            # ``t[i] = <Python number>``: PyTorch makes the value on ``t``'s own device
            # (``scalarToTensor`` in python_variable_indexing.cpp: a fill on CUDA, no copy); on a CPU
            # run it is a CPU scalar, which must not read as a host-to-device copy.
            with self.placing("device"):
                return func(*args, **kwargs)
        if func in sync_rules.DATA_CREATORS:
            return self._create_from_data(func, args, kwargs)
        if func is torch.Tensor.new_tensor and "device" not in kwargs and not self.placement.is_host(args[0]):
            # x.new_tensor(data) lands on x's device: a blocking copy of host data
            return self._create_from_data(torch.tensor, args[1:], {**kwargs, "device": args[0].device},
                                          name="Tensor.new_tensor")
        if func in sync_rules.FACTORIES:
            device = kwargs.get("device")
            placement = "device" if device is not None and self.is_device_target(device) else "host"
            with self.placing(placement):
                return func(*args, **kwargs)
        if func is torch.Tensor.to and not self.placement.by_device_type:
            return self._tensor_to(func, args, kwargs)
        return func(*args, **kwargs)

    def _create_from_data(self, func, args: tuple, kwargs: dict, name: str | None = None):
        data = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(data, torch.Tensor):  # a conversion of existing data: the ops decide
            return func(*args, **kwargs)
        device = kwargs.get("device")
        if device is not None and self.placement.by_device_type and self.is_device_target(device):
            self.crossing("h2d", False, False, f"{name or 'torch.' + func.__name__}(host data, device={device!s})")
        # On a CPU run ``device=`` names the CPU whatever the code means: host data either way. The
        # production idiom ``torch.tensor(lst, device="cpu").to(device, non_blocking=True)`` then
        # crosses at the copy, as on CUDA; a host tensor that a device op reads without that copy
        # (``torch.tensor(lst, device=device)`` used directly: a blocking copy on CUDA) fails there.
        with self.placing("host"):
            return func(*args, **kwargs)

    def _tensor_to(self, func, args: tuple, kwargs: dict):
        """``Tensor.to`` on a CPU run: ``host.to(device)`` is a host-to-device copy."""
        t = args[0]
        target, dtype, non_blocking = None, kwargs.get("dtype"), bool(kwargs.get("non_blocking", False))
        for a in args[1:]:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, str | torch.device):
                target = a
            elif isinstance(a, torch.Tensor):
                target, dtype = (None if self.placement.is_host(a) else "device"), a.dtype
            elif isinstance(a, bool):
                non_blocking = a
        target = kwargs.get("device", target)
        if target is None or not self.placement.is_host(t):
            return func(*args, **kwargs)
        self.crossing("h2d", self.placement.is_pinned(t), non_blocking, "Tensor.to(device) of host data")
        with self.placing("device"):
            out = torch.empty_like(t, dtype=dtype or t.dtype)
            out.copy_(t, non_blocking=True)
        return out

    def dispatch(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict):
        pl = self.placement
        if self._override == "host" or (func is aten.lift_fresh.default and self._override != "device"):
            out = func(*args, **kwargs)
            for t in _tensors((args, kwargs, out)):
                pl.tag_host(t)
            return out
        tensors = _tensors((args, kwargs))
        device_in = [t for t in tensors if not pl.is_host(t)]
        crossing = sync_rules.copy_direction(func, args, kwargs, pl)
        if crossing is not None:
            direction, pinned, non_blocking = crossing
            self.crossing(direction, pinned, non_blocking, f"copy {func.overloadpacket.__name__}")
        elif device_in:
            if func is aten._local_scalar_dense.default:
                self.violation(f"a host read (.item() / bool() / int()) of device data {tuple(device_in[0].shape)}",
                               "read")
            if func.overloadpacket in _HOST_VALUE_OPS:
                self.violation(f"{func.overloadpacket.__name__} (returns a host value computed from device data)",
                               "read")
            reason = sync_rules.data_dependent_reason(func, args, kwargs, pl.is_host)
            if reason is not None:
                self.violation(reason, "shape")
            big_host = [t for t in tensors if t.dim() > 0 and t.numel() > 0 and pl.is_host(t)]
            if big_host:
                self.violation(f"host tensor of shape {tuple(big_host[0].shape)} read by device op {func}", "mixed")
        if tensors:
            device_op = bool(device_in) or crossing is not None or self._override == "device"
        elif pl.by_device_type:
            device_op = None  # decided by the output's device below
        else:
            device_op = True  # a factory on a CPU run: host only when created as host data
        if device_op:
            self.before_device_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if device_op is None:  # a factory on CUDA: mutates nothing, so no before_device_op
            device_op = any(not pl.is_host(t) for t in _tensors(out))
        if device_op:
            self.after_device_op(func, args, kwargs, out)
        else:
            for t in _tensors(out):
                pl.tag_host(t)
        return out


class _FunctionHook(TorchFunctionMode):
    def __init__(self, interceptor: Interceptor) -> None:
        super().__init__()
        self.ic = interceptor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ic._bypass:
            return func(*args, **kwargs)
        return self.ic.function_call(func, args, kwargs)


class _DispatchHook(TorchDispatchMode):
    def __init__(self, interceptor: Interceptor) -> None:
        super().__init__()
        self.ic = interceptor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ic._bypass:
            return func(*args, **kwargs)
        return self.ic.dispatch(func, args, kwargs)
