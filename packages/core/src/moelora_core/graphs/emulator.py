"""The graph emulator: what a CUDA graph does to a program, reproduced on any device.

Capture runs the callable once under the interceptor (:mod:`.interception`) and records:

- every device op (aten level) with its arguments; Python scalars in the arguments are frozen;
- every Triton launch with its grid evaluated once (frozen) and its arguments (:mod:`.triton_launches`);
  op recording is paused inside a launch, since the interpreter issues its own torch ops.

Tensors are bound by storage: each recorded argument is an alias of the capture-time storage,
offset, sizes and strides, so rebinding a Python name (or ``set_``) after capture does not
change what replay reads -- as on CUDA, where the graph holds addresses. Tensors allocated by
recorded ops become captured storage, reused on every replay (the CUDA graph pool); replay
re-issues the recording in order and writes each op's result into its captured storage.
A 0-dim host tensor read by a device op is a scalar argument: its value is frozen at capture.

As on CUDA, capture does not leave the work done: storages that existed before capture and
were written by recorded ops are restored afterwards, and captured storage is poisoned (NaN
for floating dtypes, the dtype's minimum for integers) until the first replay writes it.
Ops that only allocate (``empty``) record nothing, so what they hold is whatever the last
replay left. Random ops draw from the default generator at every replay, as the same eager
call would (CUDA graphs do so through philox offsets), and capture draws nothing. Host syncs
raise :class:`~moelora_core.errors.HostSyncError` at capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from moelora_core.graphs.interception import Interceptor, _tensors
from moelora_core.graphs.sync_rules import ALLOC_ONLY_OPS
from moelora_core.graphs.triton_launches import evaluate_grid, intercept_triton_launches


@dataclass(frozen=True)
class _OpStep:
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    writeback: tuple[tuple[int, torch.Tensor], ...]  # (index among the output's leaves, captured alias)
    #: Whether the op ran under ``torch.inference_mode`` at capture (code that enters it itself, e.g.
    #: vLLM's LoRA ops, makes inference tensors an in-place replay outside it would refuse).
    inference: bool = False

    def replay(self) -> None:
        if self.inference and not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                self._run()
        else:
            self._run()

    def _run(self) -> None:
        out = self.func(*self.args, **self.kwargs)
        if self.writeback:
            leaves = tree_leaves(out)
            for index, dst in self.writeback:
                dst.copy_(leaves[index])


@dataclass(frozen=True)
class _LaunchStep:
    kernel: object
    args: tuple
    kwargs: dict
    grid: tuple[int, ...]

    def replay(self) -> None:
        # through the kernel's run attribute: a replay inside another capture is recorded there
        self.kernel.run(*self.args, grid=self.grid, warmup=False, **self.kwargs)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage, offset, sizes and strides (bound by storage, not by name)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
    )


def _poison_value(dtype: torch.dtype) -> float | int | None:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return torch.iinfo(dtype).min


class Recorder(Interceptor):
    """The capture-time interceptor: checks host syncs and records device ops and launches.

    Args:
        device: the device the captured program computes on.
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device, where="during graph capture", capture=True)
        self.steps: list[_OpStep | _LaunchStep] = []
        self.num_ops = 0
        self.num_launches = 0
        # storage data_ptr -> (storage, dtype) of storage allocated by recorded ops
        self._fresh: dict[int, tuple[torch.UntypedStorage, torch.dtype]] = {}
        # storage data_ptr -> (storage, copy before capture) of pre-existing storage written by the capture
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- binding -------------------------------------------------------------------------------
    def _bind_storage(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._aliases.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        alias = _alias(t)
        self._aliases[id(t)] = (t, alias)  # holding t keeps its id unique while capturing
        return alias

    def _bind_op_arg(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 and self.placement.is_host(t) and not self.placement.is_pinned(t):
            return t.clone()  # a host scalar: its value is a kernel argument, frozen at capture
        return self._bind_storage(t)

    def _save(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._fresh and ptr not in self._saved:
            self._saved[ptr] = (storage, storage.clone())

    # -- interceptor hooks ---------------------------------------------------------------------
    def before_device_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        if not func._schema.is_mutable:
            return
        with self.paused():
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    for t in _tensors(args[i] if i < len(args) else kwargs.get(arg.name)):
                        self._save(t)

    def after_device_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> None:
        with self.paused():
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            writeback = []
            for index, leaf in enumerate(tree_leaves(out)):
                if not isinstance(leaf, torch.Tensor):
                    continue
                storage = leaf.untyped_storage()
                if storage.data_ptr() in inputs:
                    continue  # a view of an input, or the input it wrote in place
                self._fresh[storage.data_ptr()] = (storage, leaf.dtype)
                writeback.append((index, self._bind_storage(leaf)))
            if func in ALLOC_ONLY_OPS or (not writeback and not func._schema.is_mutable):
                return  # views and allocations: no kernel to re-issue
            bound_args, bound_kwargs = tree_map_only(torch.Tensor, self._bind_op_arg, (args, kwargs))
            self.steps.append(_OpStep(func, bound_args, bound_kwargs, tuple(writeback),
                                      torch.is_inference_mode_enabled()))
            self.num_ops += 1

    def on_launch(self, kernel: object, run: Callable, args: tuple, kwargs: dict, grid: object) -> object:
        """Record one Triton launch and run it (paused: the interpreter's own ops are not recorded)."""
        with self.paused():
            frozen = evaluate_grid(kernel, grid, args, kwargs)
            for t in _tensors((args, kwargs)):
                self._save(t)
            result = run(kernel, *args, grid=frozen, warmup=False, **kwargs)
            bound_args, bound_kwargs = tree_map_only(torch.Tensor, self._bind_storage, (args, kwargs))
        self.steps.append(_LaunchStep(kernel, bound_args, bound_kwargs, frozen))
        self.num_launches += 1
        return result

    # -- end of capture ------------------------------------------------------------------------
    def undo(self, *, poison: bool) -> None:
        """Restore pre-existing storage written during capture; poison captured storage."""
        self._aliases.clear()  # the steps hold the bindings now
        with self.paused(), torch.no_grad():
            for storage, saved in self._saved.values():
                storage.copy_(saved)
            self._saved.clear()
            if not poison:
                return
            for storage, dtype in self._fresh.values():
                value = _poison_value(dtype)
                if value is None or storage.nbytes() < dtype.itemsize:
                    continue
                n = storage.nbytes() // dtype.itemsize
                torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (n,), (1,)).fill_(value)


class EmulatedGraph:
    """A captured program, replayed by re-issuing its recording. Built by ``GraphPool.capture``.

    Attributes:
        kind: ``"emulated"``.
        family: the pool's graph family.
        output: what the callable returned at capture (its tensors are captured storage).
        num_ops: device ops re-issued per replay; num_launches: Triton launches per replay.
    """

    kind = "emulated"

    def __init__(self, family: str, recorder: Recorder, output: object) -> None:
        self.family = family
        self.output = output
        self._steps = tuple(recorder.steps)
        self.num_ops = recorder.num_ops
        self.num_launches = recorder.num_launches

    def replay(self) -> object:
        """Re-issue the recording; returns ``output`` (same tensors every time, updated in place)."""
        with torch.no_grad():
            for step in self._steps:
                step.replay()
        return self.output


def capture_emulated(fn: Callable[[], object], device: torch.device, family: str) -> EmulatedGraph:
    """Capture ``fn`` on the emulator (warm-up is the caller's business).

    Raises:
        HostSyncError: ``fn`` synchronises with the host; nothing is left captured.
    """
    recorder = Recorder(device)
    rng = _RngState(device)
    done = False
    try:
        with recorder.active(), intercept_triton_launches(recorder.on_launch):
            output = fn()
        done = True
    finally:
        recorder.undo(poison=done)
        rng.restore()
    return EmulatedGraph(family, recorder, output)


class _RngState:
    """The default generators' state, restored after capture: a CUDA capture draws nothing from
    them (random ops in a graph take their offsets at replay), so neither does the emulator's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
