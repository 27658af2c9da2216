"""The suite's own record of every adapter it loads, and the check that a backend never writes the pool.

Expected values must not come from anything the backend under test can change (DESIGN.md §5: the
pool is read-only to a backend). So the harness keeps two things apart from the ``LoRAWeights``
pools it hands the backend:

- :class:`AdapterSnapshot`: per MoE layer and slot, the factors and σ the suite *drew* (or read from
  an adapter file independently of moelora's readers), as CPU copies made before the pool ever saw
  them. The oracle reads :meth:`AdapterSnapshot.pool_view` — stacked, zero-padded tensors built here
  with plain torch — never the pool: a backend that rescales the pool's B in place, or a pool that
  keeps a previous adapter's modules in a reused slot, changes the actual output and not the
  expected one.
- :class:`PoolGuard`: bitwise copies of every pool tensor (and its host lists) as loaded; after every
  backend call the harness makes (prepare, each delta, ``moe_forward``, the slot-load hook, a graph
  capture, a replay) the pools must be unchanged, bit for bit (:class:`PoolWritten` otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moelora_core.layer_spec import ALL_MODULES, EXPERT_FACTORS, MOE_MODULES, LoRALayerSpec
from moelora_core.weights import LoRAWeights, ModuleLoRA

F64 = torch.float64


class PoolWritten(AssertionError):
    """A backend call changed the adapter pool it was handed (read-only to a backend, DESIGN.md §5)."""


@dataclass
class SlotRecord:
    """One slot's adapter as the suite loaded it: module → (A, B, σ) on the CPU (the pool's dtype)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    adapter_scaling: float


class PoolView:
    """The oracle's view of one layer's adapters, shaped like ``LoRAWeights`` (``spec``, the six MoE
    factor views, ``factors``, ``scalings``, ``ranks``) but built from a snapshot with plain torch.

    Args:
        spec: the layer spec (shapes); slots: slot → its record (absent: empty).
    """

    def __init__(self, spec: LoRALayerSpec, slots: Mapping[int, SlotRecord]) -> None:
        self.spec = spec
        L, E, R = spec.max_loras, spec.E, spec.R
        self._A: dict[str, torch.Tensor] = {}
        self._B: dict[str, torch.Tensor] = {}
        self._sigma = {m: torch.zeros(L, dtype=torch.float32) for m in ALL_MODULES}
        self._rank = {m: torch.zeros(L, dtype=torch.int32) for m in ALL_MODULES}
        for m in (*MOE_MODULES, *spec.dense_shapes):
            fin, fout = spec.module_shape(m)
            lead = (E,) if m in MOE_MODULES else ()
            self._A[m] = torch.zeros(L, *lead, R, fin, dtype=spec.dtype)
            self._B[m] = torch.zeros(L, *lead, fout, R, dtype=spec.dtype)
        for slot, record in slots.items():
            for m, (A, B, sigma) in record.modules.items():
                r = A.shape[-2]
                self._A[m][slot, ..., :r, :] = A
                self._B[m][slot, ..., :, :r] = B
                self._sigma[m][slot] = sigma
                self._rank[m][slot] = r

    gate_A = property(lambda self: self._A["gate"])
    up_A = property(lambda self: self._A["up"])
    down_A = property(lambda self: self._A["down"])
    gate_B = property(lambda self: self._B["gate"])
    up_B = property(lambda self: self._B["up"])
    down_B = property(lambda self: self._B["down"])

    def factors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._A[module], self._B[module]

    def scalings(self, module: str) -> torch.Tensor:
        return self._sigma[module]

    def ranks(self, module: str) -> torch.Tensor:
        return self._rank[module]


@dataclass
class AdapterSnapshot:
    """Every MoE layer's adapters as the suite loaded them (module docstring).

    Attributes:
        specs: each MoE layer's spec (layer 1 first). slots: per layer, slot → record.
        version: bumped by every change (views are rebuilt then).
    """

    specs: list[LoRALayerSpec]
    slots: list[dict[int, SlotRecord]] = field(default_factory=list)
    version: int = 0
    _views: dict[int, tuple[int, PoolView]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [{} for _ in self.specs]

    @classmethod
    def of_pools(cls, pools: Sequence[LoRAWeights]) -> AdapterSnapshot:
        """A snapshot of what ``pools`` hold now, read back from them: for values the suite did not
        draw itself (a checkpoint pass over pools its readers filled). Not independent of the pools:
        take it before any backend call."""
        snap = cls([p.spec for p in pools])
        for layer, pool in enumerate(pools):
            for slot in range(pool.spec.max_loras):
                mods = {}
                for m in (*MOE_MODULES, *pool.spec.dense_shapes):
                    r = pool.host_ranks[m][slot]
                    if r:
                        A, B = pool.factors(m)
                        mods[m] = ModuleLoRA(A[slot, ..., :r, :], B[slot, ..., :, :r], pool.host_scalings[m][slot])
                if mods:
                    snap.record(layer, slot, mods, pool.host_adapter_scalings[slot])
        return snap

    def record(self, layer: int, slot: int, modules: Mapping[str, ModuleLoRA] | None,
               adapter_scaling: float = 0.0) -> None:
        """Record what the suite loads into ``slot`` of layer ``layer`` (None: the slot is cleared).
        Factors are copied to the CPU in the pool's dtype, so later writes to the caller's tensors
        (or to the pool) do not reach the record."""
        if modules is None:
            self.slots[layer].pop(slot, None)
        else:
            dtype = self.specs[layer].dtype
            self.slots[layer][slot] = SlotRecord(
                {m: (lora.lora_A.detach().to("cpu", dtype).clone(), lora.lora_B.detach().to("cpu", dtype).clone(),
                     float(lora.scaling)) for m, lora in modules.items()}, float(adapter_scaling))
        self.version += 1

    def pool_view(self, layer: int) -> PoolView:
        """Layer ``layer``'s adapters as a :class:`PoolView` (CPU), current with the records."""
        cached = self._views.get(layer)
        if cached is None or cached[0] != self.version:
            spec = self.specs[layer]
            view_spec = LoRALayerSpec(
                hidden_size=spec.H, moe_intermediate_size=spec.I, num_experts=spec.E, top_k=spec.top_k,
                dense_shapes=dict(spec.dense_shapes), max_loras=spec.max_loras, max_rank=spec.R, dtype=spec.dtype,
                device=torch.device("cpu"), virtual_experts=spec.virtual_experts)
            cached = (self.version, PoolView(view_spec, self.slots[layer]))
            self._views[layer] = cached
        return cached[1]


def _pool_tensors(pool: LoRAWeights) -> dict[str, torch.Tensor]:
    # As stored: a factor kept once per slot is compared once (its stride-0 view would be E copies).
    named = {f: pool.storage(f) for f in EXPERT_FACTORS}
    named.update({"module_ranks": pool.module_ranks, "module_scalings": pool.module_scalings})
    named.update({f"dense_A[{m}]": t for m, t in pool.dense_A.items()})
    named.update({f"dense_B[{m}]": t for m, t in pool.dense_B.items()})
    return named


def _host_lists(pool: LoRAWeights) -> tuple:
    return ({m: list(v) for m, v in pool.host_ranks.items()}, {m: list(v) for m, v in pool.host_scalings.items()},
            list(pool.host_adapter_scalings))


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_OF_SIZE[t.element_size()])


class PoolGuard:
    """Bitwise copies of pools as loaded, and the check that they are unchanged (module docstring).

    Args:
        pools: every MoE layer's pool, layer 1 first.
    """

    def __init__(self, pools: Sequence[LoRAWeights]) -> None:
        self.pools = list(pools)
        self.refresh()

    def refresh(self) -> None:
        """Take the pools as they are now as the reference (after the suite loaded or cleared a slot)."""
        self._tensors = [{n: t.detach().clone() for n, t in _pool_tensors(p).items()} for p in self.pools]
        self._ptrs = [{n: t.data_ptr() for n, t in _pool_tensors(p).items()} for p in self.pools]
        self._host = [_host_lists(p) for p in self.pools]

    def check(self, after: str) -> None:
        """Raise :class:`PoolWritten` if a pool differs from its reference in any bit.

        Args:
            after: the backend call just made (for the message).
        """
        for layer, (pool, ref, ptrs, host) in enumerate(zip(self.pools, self._tensors, self._ptrs, self._host)):
            for name, t in _pool_tensors(pool).items():
                if t.data_ptr() != ptrs[name]:
                    raise PoolWritten(f"after {after}: the pool of MoE layer {layer + 1} has a new {name} tensor "
                                      "(a backend must not replace the pool's tensors)")
                same = _bits(t) == _bits(ref[name])
                if not bool(same.all()):
                    where = (~same).nonzero()[0].tolist()
                    # the slot axis: [2, L, ...] gate_up stacks and [modules, L] ranks / σ; [L, ...] otherwise
                    slot = where[1] if name.startswith(("gate_up", "module_")) else where[0]
                    raise PoolWritten(
                        f"after {after}: the backend wrote the adapter pool of MoE layer {layer + 1}: {name} differs "
                        f"in {int((~same).sum())} of {t.numel()} elements (first at {tuple(where)}, slot {slot}: "
                        f"was {float(ref[name][tuple(where)]):.6g}, now {float(t[tuple(where)]):.6g}). The pool is "
                        "read-only to a backend; fold σ or re-pack into a private copy in on_slot_loaded")
            if _host_lists(pool) != host:
                raise PoolWritten(f"after {after}: the backend changed the host ranks / σ lists of the pool of MoE "
                                  f"layer {layer + 1}")


