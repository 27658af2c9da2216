"""The backend protocol (DESIGN.md §5) and loading a backend by name.

A backend is built by ``factory(spec) -> Backend``, once per engine (per device and TP rank): the
engine's eager passes and every graph bucket of both families share it. It never owns adapter
weights: every call takes a ``LoRAWeights``, as kernels do. The base MoE (routing, base GEMMs,
activation, top-k sum) is run by the caller; the backend adds LoRA deltas in place.

The previous version's entry points (``init_decode_graph``, ``init_prefill_graph``) and fields are
listed with their replacements in ``conformance/docs/migration.md``; :func:`check_protocol` refuses a
backend that still implements only the old ones, naming the new.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities, Fallback
from moelora_core.errors import InvalidFieldError, RenamedError, UnsupportedBaseQuantError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights

#: Short names of the built-in backends → ``module:factory``.
BUILTIN_BACKENDS: dict[str, str] = {
    "reference": "moelora_reference.backend:make_backend",
    "triton": "moelora_backends.triton_backend:make_backend",
    "csgmv": "moelora_backends.csgmv_backend:make_backend",
}


@runtime_checkable
class Backend(Protocol):
    """What the suite, the engine and third parties call.

    Attributes:
        name: short name for reports.
        version: the implementation's version string.
        spec: the ``LoRALayerSpec`` it was built for.

    Shapes below: T tokens (graph mode: token capacity), k = top_k, H, I from the spec.
    """

    name: str
    version: str
    spec: LoRALayerSpec

    def capabilities(self) -> Capabilities:
        """The declared features (constant for the backend's life)."""
        ...

    def prepare(self, batch: BatchSpec, family: str | None = None,
                bucket: GraphCapacity | None = None) -> LoRABatchInfo | Fallback:
        """Metadata for ``batch`` from host lists only (no device reads).

        ``family`` None = eager (fresh tensors); "decode" / "prefill" = write that family's static
        buffers in place (after ``init_graph``) and return an info whose device fields are views of
        those buffers and whose host numbers are the capacities of ``bucket`` (a capacity within the
        family's; None: the family's own). Every bucket of a family reads the same memory: views
        ``[:n]`` of one buffer set, with the tails up to the bucket's lengths reset by every prepare.
        A batch over the bucket's capacity returns ``Fallback(reason)`` and writes nothing.
        """
        ...

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        """Allocate graph family ``family``'s static buffers once, at ``capacity`` (its largest
        bucket): ``GraphCapacity.decode(max_bs, tokens_per_request)`` or
        ``GraphCapacity.prefill(max_num_tokens, max_num_requests)`` (no fixed request cap). Decode and
        prefill families share no storage."""
        ...

    def moe_gate_up_delta(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        gate_up_out: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
    ) -> None:
        """Add σ·B(A x) of gate (columns [:I]) and up (columns [I:]) into ``gate_up_out`` in place.

        Args:
            x: [T, H] activations.
            topk_ids: [T, k] int expert ids; ids < 0 or >= E add nothing.
            gate_up_out: [T, k, 2I] base gate_up output per (token, k), before the activation.
        """
        ...

    def moe_down_delta(
        self,
        h: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        down_out: torch.Tensor,
        weights: LoRAWeights,
        info: LoRABatchInfo,
    ) -> None:
        """Add w_k·σ·B_down(A_down h) into ``down_out`` in place.

        Args:
            h: [T * k, I] activated intermediate, row ``t * k + j`` for pair (t, j).
            topk_ids: [T, k] int expert ids.
            topk_weights: [T, k] fp32 router weights.
            down_out: [T, k, H] router-weighted base down output per pair (summed over k later).
        """
        ...

    def dense_delta(
        self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo
    ) -> None:
        """Add σ·B(A x) of dense ``module`` ("q", "k", "v", "o") into ``out`` [T, out] in place."""
        ...


BackendFactory = Callable[[LoRALayerSpec], Backend]


def notify_slot_loaded(backend: object, slot: int, weights: LoRAWeights) -> None:
    """Tell ``backend`` that ``slot`` of ``weights`` was loaded, reloaded or cleared.

    The one place the optional ``on_slot_loaded(slot, weights)`` hook is called (DESIGN.md §5): the
    pool's owner (the suite's harness, the engine's adapter pool) calls this after every
    ``LoRAWeights.load_slot`` / ``clear_slot``. A backend whose capabilities declare
    ``slot_load_hook`` gets the call (it may fold σ or re-pack the slot into its own copy, once);
    for any other backend this does nothing.
    """
    hook = getattr(backend, "on_slot_loaded", None)
    if hook is not None and getattr(backend.capabilities(), "slot_load_hook", False):
        hook(slot, weights)


def check_base_quant_served(name: str, caps: Capabilities, base_quant: str) -> None:
    """Refuse, at start-up, a backend that does not declare ``base_quant`` (DESIGN.md §1, "Quantized
    base"): the engine calls this before reading a checkpoint, the suite before building a layer.

    Args:
        name: the backend's name for the message (the short name or ``module:factory``).
        caps: its capabilities. base_quant: the model's ``LoRALayerSpec.base_quant``.

    Raises:
        UnsupportedBaseQuantError: ``backend 'csgmv' does not declare base_quant=fp8_block``.
    """
    if base_quant not in getattr(caps, "base_quants", frozenset({"none"})):
        raise UnsupportedBaseQuantError(name, base_quant)


def check_protocol(backend: object) -> None:
    """Refuse a backend written for the previous protocol version: one that implements
    ``init_decode_graph`` / ``init_prefill_graph`` but not ``init_graph``, or ``prepare`` without a
    ``bucket`` parameter, while declaring graph families.

    Raises:
        RenamedError: naming the entry point to implement instead.
    """
    caps = backend.capabilities()
    if not caps.graph_families:
        return
    name = type(backend).__name__
    if not callable(getattr(backend, "init_graph", None)):
        old = [m for m in ("init_decode_graph", "init_prefill_graph") if callable(getattr(backend, m, None))]
        raise RenamedError(f"{name}.{' / '.join(old) or 'init_*_graph'}",
                           "implement init_graph(family, capacity) (one buffer set per graph family, allocated at "
                           "its largest bucket)")
    params = inspect.signature(backend.prepare).parameters
    if "bucket" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise RenamedError(f"{name}.prepare(batch, family)",
                           "prepare(batch, family=None, bucket=None): a graph bucket's views of the family's "
                           "buffers")


def load_backend(target: str) -> BackendFactory:
    """Resolve ``"module:factory"`` (or a built-in name: reference, triton, csgmv) to a factory.

    A module that is not importable from ``sys.path`` is looked up in the current directory as well,
    as ``python -m pytest`` finds a test's helper module: ``--backend my_backend:make`` works from the
    directory that holds ``my_backend.py`` without ``PYTHONPATH=.`` (the directory is then added to
    ``sys.path`` for this process; child processes inherit the working directory and do the same).

    Raises:
        InvalidFieldError: malformed target, module not importable, or no such attribute.
    """
    resolved = BUILTIN_BACKENDS.get(target, target)
    module_name, sep, attr = resolved.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidFieldError(
            "backend", f"expected 'module:factory' or one of {sorted(BUILTIN_BACKENDS)}, got {target!r}"
        )
    try:
        module = _import_backend_module(module_name)
    except ImportError as exc:
        raise InvalidFieldError("backend", f"cannot import {module_name!r} for {target!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InvalidFieldError("backend", f"{module_name!r} has no callable {attr!r} (from {target!r})")
    return factory


def _import_backend_module(module_name: str):
    """``importlib.import_module``, retried with the current directory on ``sys.path`` when the
    top-level package is missing and the current directory holds it (``load_backend``'s doc)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        here = Path(cwd)
        if exc.name != top or not ((here / f"{top}.py").is_file() or (here / top).is_dir()):
            raise
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)
