"""Intercepting Triton launches, compiled or interpreted, without importing Triton.

``kernel[grid](*args, **kwargs)`` ends in ``run(*args, grid=..., warmup=False, **kwargs)`` of the
kernel object: ``triton.runtime.jit.JITFunction.run`` when compiled, and
``triton.runtime.interpreter.InterpretedFunction.run`` under ``TRITON_INTERPRET=1`` (which hands
the grid to ``GridExecutor``). ``@triton.autotune`` and ``@triton.heuristics`` wrappers call the
inner kernel's ``run`` with the chosen meta-parameters, so patching ``run`` on those two classes
sees every launch once, with its final arguments.

moelora_core does not depend on Triton: interception happens only if Triton is already imported
(any module that defines a kernel has imported it), and is a no-op otherwise.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: on_launch(kernel, original_run, args, kwargs, grid) -> whatever run returns
LaunchHandler = Callable[[object, Callable, tuple, dict, object], object]


def _kernel_classes() -> list[type]:
    if "triton" not in sys.modules:
        return []
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:  # pragma: no cover - a broken Triton install
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return classes


@contextmanager
def intercept_triton_launches(on_launch: LaunchHandler) -> Iterator[bool]:
    """Route every Triton launch in the body to ``on_launch``; yields whether Triton is present.

    ``on_launch`` receives the kernel object, the original (unpatched) ``run`` function to call
    as ``run(kernel, *args, grid=grid, warmup=False, **kwargs)``, the launch arguments and the
    grid as given (a tuple or a callable of the meta-parameters). Warm-up (compile-only) calls
    are not routed.
    """
    classes = _kernel_classes()
    originals = {cls: cls.__dict__["run"] for cls in classes}

    def patched(original: Callable) -> Callable:
        def run(self, *args, grid, warmup, **kwargs):
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return on_launch(self, original, args, kwargs, grid)

        return run

    for cls, original in originals.items():
        cls.run = patched(original)
    try:
        yield bool(classes)
    finally:
        for cls, original in originals.items():
            cls.run = original


def evaluate_grid(kernel: object, grid: object, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The launch grid as a tuple of Python ints (frozen, as a CUDA graph freezes it).

    A callable grid is called with the meta-parameters the way Triton does: every kernel
    parameter by name (positional and keyword arguments, defaults applied).

    Raises:
        ValueError: the grid has more than three axes.
    """
    if callable(grid):
        fn = getattr(kernel, "fn", kernel)
        signature = inspect.signature(fn)
        params = {k: v for k, v in kwargs.items() if k in signature.parameters}
        bound = signature.bind_partial(*args, **params)
        bound.apply_defaults()
        grid = grid(dict(bound.arguments))
    grid = tuple(int(g) for g in grid)
    if len(grid) > 3:
        raise ValueError(f"a Triton grid has at most 3 axes, got {grid}")
    return grid
