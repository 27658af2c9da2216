"""The adapter pool: adapters registered by name, served from ``max_loras`` slots of every layer's
``LoRAWeights`` (DESIGN.md §6).

- **Register** (``register`` from a directory, ``register_tensors`` from in-memory PEFT tensors):
  the adapter is read and validated by ``moelora_core.checkpoint.read_adapter`` for this model, the
  pool's R and dtype, and checked against every layer's pool (``LoRAWeights.validate``) — all before
  anything changes. A refusal raises the reader's own class and leaves the pool as it was. What the
  adapter changes (``moelora_core.checkpoint.adapter_effect``: no-op modules and adapters) is measured
  on the whole adapter, before a parallel rank's shard is taken, and kept in
  ``RegisteredAdapter.effect``.
- **Slots on demand**: ``acquire(name)`` (the scheduler, when it admits a request) returns the
  adapter's slot, loading it into a free slot or else the least recently used slot whose adapter is
  neither pinned nor used by a running request. Loading is ``load_adapter_into_slot`` (atomic over
  every layer; modules and layers the adapter lacks are zeroed) followed by
  ``notify_slot_loaded`` of the engine's one backend instance, once per layer pool (the graph
  buckets use the same instance, DESIGN.md §6).
- **In use**: running requests hold their adapter's slot (``acquire`` / ``release`` count them);
  waiting requests are counted too (``add_waiting`` / ``remove_waiting``). Reloading or unloading
  an adapter any of them uses is refused with :class:`AdapterInUseError`, so a running request's
  output never changes mid-generation; once free, a reload writes the new weights into the
  adapter's slot (when it has one) and every later request is served with them.
- **Pinning** keeps an adapter in its slot (never evicted); a pinned adapter cannot be unloaded.

All bookkeeping is host-side; the only device writes are the slot loads and clears.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelora_core.backend import notify_slot_loaded
from moelora_core.checkpoint import (
    AdapterEffect,
    AdapterWeights,
    ModelMismatchError,
    MoEModelConfig,
    adapter_effect,
    read_adapter,
)
from moelora_core.checkpoint.slot_loader import load_adapter_into_slot, refuse_layout_mismatch
from moelora_core.errors import MoeLoraError
from moelora_core.layer_spec import MOE_MODULES
from moelora_core.weights import LoRAWeights
from moelora_runner.errors import AdapterInUseError, AdapterPinnedError, NoFreeSlotError, UnknownAdapterError


@dataclass(frozen=True)
class RegisteredAdapter:
    """A registered adapter: its validated weights (on the host), where they came from, and what it
    changes (``effect``: no-op modules and the no-op verdict; None only for entries made by hand)."""

    name: str
    weights: AdapterWeights
    source: str  # the directory, or "<tensors>"
    effect: AdapterEffect | None = None


class AdapterPool:
    """Name → slot over one ``LoRAWeights`` per decoder layer (see the module doc).

    Args:
        pools: one pool per decoder layer (same spec: ``max_loras`` slots, rank R, dtype, device).
        backend: the engine's backend, told about every slot load, reload and clear (once per layer pool).
        model_config: the model adapters are read for.
        on_event: called with ("load" | "evict" | "refusal", detail) for the metrics.
        shard: this rank's slice of an adapter read for the whole model (tensor / expert parallelism:
            ``moelora_runner.parallel.sharding.shard_adapter``); None keeps it whole. Applied once at
            registration, before the pools validate it.
        inspect: measures what an adapter (read for the whole model, before ``shard``) changes; default
            ``adapter_effect`` without base weights (the exact-zero tests only). The engine passes its
            base weights for the probe.
    """

    def __init__(self, pools: Sequence[LoRAWeights], backend: object, model_config: MoEModelConfig,
                 on_event: Callable[[str, str], None] | None = None,
                 shard: Callable[[AdapterWeights], AdapterWeights] | None = None,
                 inspect: Callable[[AdapterWeights], AdapterEffect] | None = None) -> None:
        self.pools = list(pools)
        self._shard = shard or (lambda weights: weights)
        self._inspect = inspect or adapter_effect
        self.backend = backend
        self.model_config = model_config
        spec = self.pools[0].spec
        self.max_loras = spec.max_loras
        self.max_rank = spec.R
        self.dtype = spec.dtype
        self._on_event = on_event or (lambda kind, detail: None)
        self._registry: dict[str, RegisteredAdapter] = {}
        self._slots: list[str | None] = [None] * self.max_loras
        self._pinned: set[str] = set()
        self._running: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._last_used: list[int] = [0] * self.max_loras
        self._clock = 0

    # --- what is registered and loaded ---------------------------------------------------------

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._registry))

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def get(self, name: str) -> RegisteredAdapter:
        """The registered adapter ``name``.

        Raises:
            UnknownAdapterError: not registered (the message lists the registered names).
        """
        try:
            return self._registry[name]
        except KeyError:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded; loaded adapters: "
                                      f"{list(self.names()) or 'none'}") from None

    def slot_of(self, name: str) -> int | None:
        """The slot holding ``name``, or None."""
        return self._slots.index(name) if name in self._slots else None

    def slots(self) -> tuple[str | None, ...]:
        """The adapter in each slot (None = free)."""
        return tuple(self._slots)

    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def in_use(self, name: str) -> bool:
        """Whether a running or waiting request uses ``name``."""
        return self._running[name] > 0 or self._waiting[name] > 0

    def slot_ranks(self) -> tuple[int, ...]:
        """Per slot, the largest rank of its adapter over every layer (``BatchSpec.lora_ranks``; 0 = empty)."""
        return tuple(max(p.slot_rank(s) for p in self.pools) for s in range(self.max_loras))

    def slot_scalings(self) -> tuple[float, ...]:
        """Per slot, the adapter-level σ (``BatchSpec.scalings``; the same in every layer's pool)."""
        return self.pools[0].slot_scalings()

    def slot_bytes(self) -> int:
        """Device bytes one slot takes over every layer's pool."""
        # As stored: a factor the pools' expert layout shares is counted once per slot, not E times.
        return sum(p.slot_bytes() for p in self.pools)

    # --- registration --------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> RegisteredAdapter:
        """Read and validate the PEFT adapter at ``path`` as ``name`` (a new name, or a reload).

        Raises:
            the reader's refusals (``moelora_core.checkpoint.ADAPTER_REFUSALS``), InvalidFieldError
            (a pool refuses a factor): nothing changed.
            AdapterInUseError: ``name`` is registered and a running or waiting request uses it.
        """
        self._check_name(name)
        self._refuse_if_in_use(name, "reload")
        try:
            whole = read_adapter(path, self.model_config, name=name, dtype=self.dtype, max_rank=self.max_rank)
            weights = self._shard(whole)
            self._validate_against_pools(weights)
        except MoeLoraError as exc:
            self._on_event("refusal", type(exc).__name__)
            raise
        return self._install(RegisteredAdapter(name, weights, str(path), self._inspect(whole)))

    def register_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], config: Any) -> RegisteredAdapter:
        """Register an adapter from in-memory PEFT tensors (what RL weight sync hands over).

        Args:
            tensors: the adapter's state dict with the keys of ``adapter_model.safetensors``
                (``get_peft_model_state_dict`` output: ``base_model.model.model.layers.0.self_attn.
                q_proj.lora_A.weight``, ...); any device and floating dtype.
            config: the ``adapter_config.json`` contents as a mapping, or an object with
                ``to_dict()`` (peft's ``LoraConfig``).

        The tensors and the config go through the same reader as files (written to a temporary
        directory and read back), so they get exactly the same validation and refusals.

        Raises:
            as :meth:`register`; AdapterFormatError: tensors that are not a mapping of tensors or a
            config that is not JSON-serialisable.
        """
        from safetensors.torch import save_file

        from moelora_core.checkpoint import AdapterFormatError

        self._check_name(name)
        self._refuse_if_in_use(name, "reload")
        raw = config.to_dict() if hasattr(config, "to_dict") else config
        try:
            if not isinstance(raw, Mapping):
                raise AdapterFormatError(name, "config", "must be a mapping (adapter_config.json) or have to_dict()",
                                         found=type(config).__name__)
            if not isinstance(tensors, Mapping) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise AdapterFormatError(name, "tensors", "must be a mapping of key -> torch.Tensor")
            with tempfile.TemporaryDirectory(prefix="moelora-adapter-") as tmp:
                directory = Path(tmp)
                try:
                    text = json.dumps(dict(raw), default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                                      else str(o))
                except (TypeError, ValueError) as exc:
                    raise AdapterFormatError(name, "config", f"not JSON-serialisable: {exc}") from None
                (directory / "adapter_config.json").write_text(text)
                save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()},
                          str(directory / "adapter_model.safetensors"))
                whole = read_adapter(directory, self.model_config, name=name, dtype=self.dtype,
                                     max_rank=self.max_rank)
                weights = self._shard(whole)
            self._validate_against_pools(weights)
        except MoeLoraError as exc:
            self._on_event("refusal", type(exc).__name__)
            raise
        return self._install(RegisteredAdapter(name, weights, "<tensors>", self._inspect(whole)))

    def unregister(self, name: str) -> None:
        """Forget ``name`` and clear its slot in every layer.

        Raises:
            UnknownAdapterError: not registered. AdapterInUseError: a running or waiting request uses it.
            AdapterPinnedError: it is pinned.
        """
        self.get(name)
        self._refuse_if_in_use(name, "unload")
        if name in self._pinned:
            raise AdapterPinnedError(f"adapter {name!r} is pinned; unpin it before unloading")
        slot = self.slot_of(name)
        if slot is not None:
            for pool in self.pools:
                pool.clear_slot(slot)
            self._notify(slot)
            self._slots[slot] = None
        del self._registry[name]

    def _check_name(self, name: object) -> None:
        if not isinstance(name, str) or not name:
            raise UnknownAdapterError(f"an adapter name must be a non-empty string, got {name!r}")

    def _refuse_if_in_use(self, name: str, what: str) -> None:
        if name in self._registry and self.in_use(name):
            raise AdapterInUseError(
                f"cannot {what} adapter {name!r}: {self._running[name]} running and {self._waiting[name]} waiting "
                f"request(s) use it; {what} it once they have finished")

    def _validate_against_pools(self, weights: AdapterWeights) -> None:
        if weights.num_layers != len(self.pools):
            raise ModelMismatchError(weights.name, "layers", "one set of modules per decoder layer is needed",
                                     expected=len(self.pools), found=weights.num_layers)
        for layer, (pool, modules) in enumerate(zip(self.pools, weights.layers)):
            for module, lora in modules.items():  # ExpertLayoutError before the pool's own checks
                if module in MOE_MODULES:
                    refuse_layout_mismatch(pool.spec, weights, layer, module, lora)
            pool.validate(0, dict(modules))

    def _install(self, entry: RegisteredAdapter) -> RegisteredAdapter:
        self._registry[entry.name] = entry
        slot = self.slot_of(entry.name)
        if slot is not None:  # a reload of an adapter that has a slot: new weights there now
            self._load(slot, entry)
        return entry

    # --- slots ---------------------------------------------------------------------------------

    def _load(self, slot: int, entry: RegisteredAdapter) -> None:
        load_adapter_into_slot(self.pools, slot, entry.weights)
        self._notify(slot)
        self._slots[slot] = entry.name
        self._on_event("load", entry.name)

    def _notify(self, slot: int) -> None:
        # One backend instance serves every layer and every graph bucket, each layer with its own pool:
        # the hook hears of the slot once per pool.
        for pool in self.pools:
            notify_slot_loaded(self.backend, slot, pool)

    def _victim(self, keep: str | None = None) -> int | None:
        """A slot to (re)use: the lowest free one, else the least recently used whose adapter is
        neither pinned nor running (nor ``keep``); None when every slot is held."""
        for slot, held in enumerate(self._slots):
            if held is None:
                return slot
        candidates = [s for s, held in enumerate(self._slots)
                      if held not in self._pinned and self._running[held] == 0 and held != keep]
        return min(candidates, key=lambda s: self._last_used[s]) if candidates else None

    def _ensure_slot(self, name: str) -> int | None:
        slot = self.slot_of(name)
        if slot is not None:
            return slot
        entry = self.get(name)
        slot = self._victim(keep=name)
        if slot is None:
            return None
        evicted = self._slots[slot]
        if evicted is not None:
            self._on_event("evict", evicted)
        self._load(slot, entry)
        return slot

    def can_ever_acquire(self, name: str) -> bool:
        """False when every slot is pinned by other adapters (``name`` could never get one)."""
        return name in self._slots or sum(1 for s in self._slots if s in self._pinned) < self.max_loras

    def acquire(self, name: str) -> int | None:
        """The slot of ``name`` for a request about to run (loading it if needed), counted as a
        running use; None when no slot can be had now (the request waits).

        Raises:
            UnknownAdapterError: not registered.
        """
        slot = self._ensure_slot(name)
        if slot is None:
            return None
        self._running[name] += 1
        self.touch(slot)
        return slot

    def release(self, name: str) -> None:
        """A running request of ``name`` finished."""
        if self._running[name] <= 0:
            raise RuntimeError(f"release of adapter {name!r} without a matching acquire")
        self._running[name] -= 1

    def touch(self, slot: int) -> None:
        """Mark ``slot`` as used now (LRU order)."""
        self._clock += 1
        self._last_used[slot] = self._clock

    def add_waiting(self, name: str) -> None:
        self.get(name)
        self._waiting[name] += 1

    def remove_waiting(self, name: str) -> None:
        self._waiting[name] -= 1

    def pin(self, name: str) -> int:
        """Load ``name`` into a slot now (if needed) and keep it there until :meth:`unpin`.

        Returns:
            Its slot.

        Raises:
            UnknownAdapterError: not registered. NoFreeSlotError: every slot holds a pinned or
            running adapter.
        """
        slot = self._ensure_slot(name)
        if slot is None:
            raise NoFreeSlotError(f"cannot pin adapter {name!r}: all {self.max_loras} slots hold adapters that are "
                                  f"pinned or used by running requests ({list(self._slots)})")
        self._pinned.add(name)
        return slot

    def unpin(self, name: str) -> None:
        """Let ``name`` be evicted again (it stays in its slot until then).

        Raises:
            UnknownAdapterError: not registered.
        """
        self.get(name)
        self._pinned.discard(name)
