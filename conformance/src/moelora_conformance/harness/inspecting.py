"""The inspecting backend: the suite's dummy backend, which proves every case the harness builds is
well-formed.

``InspectingBackend`` answers every call with the reference backend (so the whole suite must pass
against it) and, before answering, checks what the harness handed it against the protocol of
DESIGN.md §5 — host-side only, so it adds no host sync and stays capturable:

- the spec: a ``LoRALayerSpec``; every batch: a ``BatchSpec`` of the pool's slot count, ranks
  within R, prepared in a graph family only after that family's init;
- every delta call: an ``info`` this backend returned (no foreign or hand-made metadata); tensors
  on the spec's device, of the spec's dtype (activations; ``gate_up_out`` / ``down_out`` in the
  harness's fp32, or the spec's dtype), contiguous where the protocol's shapes require, with the
  row count of the info (``num_tokens``); integer ``topk_ids`` and fp32 ``topk_weights``; a
  ``LoRAWeights`` of the spec's sizes whose host ranks and σ are the batch's (``BatchSpec`` and pool
  agree); dense modules of the spec.

Every call is recorded (:attr:`InspectingBackend.calls`): method, family and shapes. Build it with
``--backend moelora_conformance.harness.inspecting:make_backend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities, Fallback
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights
from moelora_reference.backend import ReferenceBackend


class MalformedCallError(AssertionError):
    """The harness handed a backend something outside the protocol."""


@dataclass(frozen=True)
class Call:
    """One recorded call: the method, the graph family (or None) and the shapes it received."""

    method: str
    family: str | None
    shapes: tuple[tuple[int, ...], ...]


class InspectingBackend:
    """The reference backend behind a protocol checker (see the module docstring).

    Args:
        spec: the layer spec.
    """

    name = "inspecting"

    def __init__(self, spec: LoRALayerSpec) -> None:
        if not isinstance(spec, LoRALayerSpec):
            raise MalformedCallError(f"factory got {type(spec).__name__}, not a LoRALayerSpec")
        self._inner = ReferenceBackend(spec)
        self.spec = spec
        self.version = f"inspecting+{self._inner.version}"
        self.calls: list[Call] = []
        self._infos: dict[int, tuple[LoRABatchInfo, BatchSpec, str | None]] = {}
        self._families: set[str] = set()

    # --- protocol ------------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self._inner.capabilities()

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        self._record("init_graph", family)
        self._inner.init_graph(family, capacity)
        self._families.add(family)

    def prepare(self, batch: BatchSpec, family: str | None = None,
                bucket: GraphCapacity | None = None) -> LoRABatchInfo | Fallback:
        self._record("prepare", family)
        if not isinstance(batch, BatchSpec):
            raise MalformedCallError(f"prepare got {type(batch).__name__}, not a BatchSpec")
        if batch.max_loras != self.spec.max_loras:
            raise MalformedCallError(f"batch for {batch.max_loras} slots, the spec has {self.spec.max_loras}")
        if any(r > self.spec.max_rank for r in batch.lora_ranks):
            raise MalformedCallError(f"batch ranks {batch.lora_ranks} exceed R={self.spec.max_rank}")
        if family is not None and family not in self._families:
            raise MalformedCallError(f"prepare in the {family} family before init_graph({family!r}, ...)")
        if bucket is not None and family is None:
            raise MalformedCallError("an eager prepare with a bucket")
        info = self._inner.prepare(batch, family, bucket)
        if isinstance(info, LoRABatchInfo):
            self._infos[id(info)] = (info, batch, family)
        return info

    def moe_gate_up_delta(self, x, topk_ids, gate_up_out, weights, info) -> None:
        self._record("moe_gate_up_delta", self._family(info), x, topk_ids, gate_up_out)
        T = self._check_info(info, weights)
        self._check_act("x", x, (T, self.spec.H))
        self._check_ids(topk_ids, T)
        self._check_out("gate_up_out", gate_up_out, (T, self.spec.top_k, 2 * self.spec.I))
        self._inner.moe_gate_up_delta(x, topk_ids, gate_up_out, weights, info)

    def moe_down_delta(self, h, topk_ids, topk_weights, down_out, weights, info) -> None:
        self._record("moe_down_delta", self._family(info), h, topk_ids, topk_weights, down_out)
        T = self._check_info(info, weights)
        k = self.spec.top_k
        self._check_out("h", h, (T * k, self.spec.I))
        self._check_ids(topk_ids, T)
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (T, k):
            raise MalformedCallError(f"topk_weights {topk_weights.dtype} {tuple(topk_weights.shape)}, expected fp32 "
                                     f"{(T, k)}")
        self._check_out("down_out", down_out, (T, k, self.spec.H))
        self._inner.moe_down_delta(h, topk_ids, topk_weights, down_out, weights, info)

    def dense_delta(self, module, x, out, weights, info) -> None:
        self._record("dense_delta", self._family(info), x, out)
        T = self._check_info(info, weights)
        if module not in self.spec.dense_shapes:
            raise MalformedCallError(f"dense module {module!r} is not in the spec {tuple(self.spec.dense_shapes)}")
        fin, fout = self.spec.dense_shapes[module]
        self._check_act("x", x, (T, fin))
        self._check_act("out", out, (T, fout))
        self._inner.dense_delta(module, x, out, weights, info)

    def moe_forward(self, x, topk_ids, topk_weights, base_weights, weights, info):
        self._record("moe_forward", self._family(info), x, topk_ids, topk_weights)
        T = self._check_info(info, weights)
        self._check_act("x", x, (T, self.spec.H))
        self._check_ids(topk_ids, T)
        return self._inner.moe_forward(x, topk_ids, topk_weights, base_weights, weights, info)

    # --- checks --------------------------------------------------------------------------------

    def _record(self, method: str, family: str | None, *tensors: torch.Tensor) -> None:
        self.calls.append(Call(method, family, tuple(tuple(t.shape) for t in tensors)))

    def _family(self, info) -> str | None:
        entry = self._infos.get(id(info))
        return entry[2] if entry else None

    def _check_info(self, info, weights) -> int:
        entry = self._infos.get(id(info))
        if entry is None or entry[0] is not info:
            raise MalformedCallError("a delta call with metadata this backend's prepare did not return")
        _, batch, _ = entry
        if not isinstance(weights, LoRAWeights):
            raise MalformedCallError(f"weights is {type(weights).__name__}, not LoRAWeights")
        w, s = weights.spec, self.spec
        theirs, mine = (w.max_loras, w.E, w.R, w.H, w.I, w.dtype), (s.max_loras, s.E, s.R, s.H, s.I, s.dtype)
        if theirs != mine:
            raise MalformedCallError(f"weights for (L, E, R, H, I, dtype) = {theirs}, the spec has {mine}")
        # A slot's batch rank is its largest over every layer (AdapterPool.slot_ranks), so a layer's
        # pool may hold less where a rank_pattern key names a layer (P13), never more.
        held = weights.slot_ranks()
        if len(held) != len(batch.lora_ranks) or any(h > b for h, b in zip(held, batch.lora_ranks)):
            raise MalformedCallError(f"the batch says ranks {batch.lora_ranks}, the pool holds {held} (a slot's "
                                     "rank in one layer's pool may not exceed the batch's)")
        if tuple(weights.slot_scalings()) != tuple(batch.scalings):
            raise MalformedCallError(f"the batch says σ {batch.scalings}, the pool holds {weights.slot_scalings()}")
        return info.num_tokens

    def _check_device(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise MalformedCallError(f"{name} is {type(t).__name__}, not a tensor")
        if t.device != self.spec.device and not (t.device.type == self.spec.device.type == "cuda"):
            raise MalformedCallError(f"{name} on {t.device}, the spec's device is {self.spec.device}")

    def _check_act(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        self._check_device(name, t)
        if t.dtype != self.spec.dtype:
            raise MalformedCallError(f"{name} is {t.dtype}, the spec's dtype is {self.spec.dtype}")
        if tuple(t.shape) != shape:
            raise MalformedCallError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.numel() and t.stride(-1) != 1:
            raise MalformedCallError(f"{name} rows are not contiguous (strides {t.stride()})")

    def _check_out(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        self._check_device(name, t)
        if t.dtype not in (torch.float32, self.spec.dtype):
            raise MalformedCallError(f"{name} is {t.dtype}; the harness passes fp32 or the spec's dtype")
        if tuple(t.shape) != shape:
            raise MalformedCallError(f"{name} has shape {tuple(t.shape)}, expected {shape}")

    def _check_ids(self, topk_ids: torch.Tensor, T: int) -> None:
        self._check_device("topk_ids", topk_ids)
        if topk_ids.is_floating_point() or tuple(topk_ids.shape) != (T, self.spec.top_k):
            raise MalformedCallError(f"topk_ids {topk_ids.dtype} {tuple(topk_ids.shape)}, expected an integer "
                                     f"[{T}, {self.spec.top_k}]")


def make_backend(spec: LoRALayerSpec) -> InspectingBackend:
    """Factory: ``--backend moelora_conformance.harness.inspecting:make_backend``."""
    return InspectingBackend(spec)
