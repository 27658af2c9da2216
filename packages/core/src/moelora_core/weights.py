"""Stacked per-slot LoRA weights of one layer (DESIGN.md §5): the pool a backend reads from.

Layout (L = max_loras, E = experts, R = max rank, H = hidden, I = MoE intermediate):

==============  =======================  =================================================
tensor          shape                    meaning
==============  =======================  =================================================
gate_up_A       [2, L, E, R, H]          A of gate (index 0) and up (index 1); one buffer so a
                                         kernel reaches both slices with one pointer + stride
gate_up_B       [2, L, E, I, R]          B of gate and up
down_A          [L, E, R, I]
down_B          [L, E, H, R]
dense_A[m]      [L, R, in_m]             m in q, k, v, o and shared_gate/up/down (those of the spec)
dense_B[m]      [L, out_m, R]
module_ranks    [len(ALL_MODULES), L]    int32; rank of each module per slot (0 = absent)
module_scalings [len(ALL_MODULES), L]    fp32; σ of each module per slot (0 where absent)
==============  =======================  =================================================

**Expert layouts** (``spec.expert_layout``, DESIGN.md §1 with B[s,e] / A[s,e] independent of e for a
shared factor): a factor of ``spec.shared_factors`` is *stored* once per slot, ``gate_up_A`` as
``[2, L, 1, R, H]`` etc. (``storage(name)``), and exposed as the ``[.., L, E, ..]`` view above with
expert stride 0 (``Tensor.expand``, no copy): every reader (kernels, twins, oracle) indexes
``[slot, e]`` as for a per-expert pool and reads the one copy. Shared-outer keeps ``gate_up_A`` and
``down_B`` once per slot; fully shared all four. A factor given with expert dim 1 (``[1, r, in]``)
loads into either kind of buffer (a per-expert buffer gets it broadcast to every expert: the
per-expert layout cannot hold it once); a per-expert factor ``[E, r, in]`` into a shared buffer is
refused (it holds one value per slot). Writes go through ``storage`` / ``stored_factors``; the
expanded views are read-only (torch refuses to write into a stride-0 view).
``slot_bytes()`` is what a slot takes as stored.

Ranks below R are zero-padded (rows of A, columns of B past r are 0); absent modules are all
zeros with rank 0 and σ 0, so they add exactly nothing. σ is never folded into B: kernels multiply
by ``module_scalings`` at run time. ``gate_A``/``up_A`` etc. are views into the stacked buffers,
and the per-expert ``[L, E, ...]`` buffers reshape to ``[L * E, ...]`` without a copy (virtual experts;
a shared factor is read there as its ``[L, ...]`` storage with ``experts_per_weight = E``).

Host copies of ranks and σ are kept so a scheduler can build a ``BatchSpec`` without reading the
device.

Loading is all-or-nothing: every argument (dims, shapes, rank, σ as an fp32 value, the factors
finite *after* the cast to the pool's dtype) is checked before the first write or clear, and
writes run under ``torch.no_grad()``, so the pool never keeps a caller's tensor or its autograd
history. The buffers are allocated outside inference mode even when the pool is built inside
one, so a pool made under ``torch.inference_mode()`` can still be loaded outside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moelora_core.adapter_config import fp32_scaling
from moelora_core.errors import InvalidFieldError, SlotError
from moelora_core.layer_spec import (
    ALL_MODULES,
    DENSE_LORA_MODULES,
    EXPERT_FACTORS,
    MOE_MODULES,
    LoRALayerSpec,
    expert_factor,
)


@dataclass(frozen=True)
class ModuleLoRA:
    """One module's LoRA factors for one adapter, as the checkpoint readers produce them.

    Attributes:
        lora_A: MoE modules: [E, r, in], or [1, r, in] for a factor shared by every expert
            (shared-outer gate/up, fully shared); dense modules: [r, in]. Any floating dtype, any
            device but ``meta``.
        lora_B: MoE modules: [E, out, r] or [1, out, r] (shared, e.g. shared-outer down); dense
            modules: [out, r].
        scaling: the module's σ (α/r or α/√r with the module's own r and α): an int or float
            that fp32 holds (checked by ``LoRAWeights.validate``).
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[-2])

    def shared(self, factor: str) -> bool:
        """Whether MoE factor ``factor`` ("A"/"B") is one tensor for every expert (expert dim 1)."""
        t = self.lora_A if factor == "A" else self.lora_B
        return t.dim() == 3 and t.shape[0] == 1


def module_index(module: str) -> int:
    """Row of ``module`` in ``module_ranks`` / ``module_scalings``.

    Raises:
        InvalidFieldError: unknown module name.
    """
    try:
        return ALL_MODULES.index(module)
    except ValueError:
        raise InvalidFieldError("module", f"unknown module {module!r}; expected one of {ALL_MODULES}") from None


class LoRAWeights:
    """The adapter pool's weights for one layer: stacked, zero-padded, σ kept apart.

    Args:
        spec: the layer spec (sizes, max_loras, R, dtype, device).

    The backend never owns these: every backend call takes them as an argument.
    """

    def __init__(self, spec: LoRALayerSpec) -> None:
        self.spec = spec
        L, E, R, H, I = spec.max_loras, spec.E, spec.R, spec.H, spec.I  # noqa: E741
        kw = {"dtype": spec.dtype, "device": spec.device}
        # Inference tensors cannot be updated in place outside inference mode: a pool built inside
        # torch.inference_mode() must still accept load_slot later.
        ex = {f: 1 if f in spec.shared_factors else E for f in EXPERT_FACTORS}
        with torch.inference_mode(False):
            self._storage = {
                "gate_up_A": torch.zeros(2, L, ex["gate_up_A"], R, H, **kw),
                "gate_up_B": torch.zeros(2, L, ex["gate_up_B"], I, R, **kw),
                "down_A": torch.zeros(L, ex["down_A"], R, I, **kw),
                "down_B": torch.zeros(L, ex["down_B"], H, R, **kw),
            }
            # The [.., L, E, ..] views every reader indexes: expert stride 0 for a shared factor.
            self._views = {f: t if t.shape[-3] == E else t.expand(*t.shape[:-3], E, *t.shape[-2:])
                           for f, t in self._storage.items()}
            self.dense_A = {m: torch.zeros(L, R, fin, **kw) for m, (fin, _) in spec.dense_shapes.items()}
            self.dense_B = {m: torch.zeros(L, fout, R, **kw) for m, (_, fout) in spec.dense_shapes.items()}
            self.module_ranks = torch.zeros(len(ALL_MODULES), L, dtype=torch.int32, device=spec.device)
            self.module_scalings = torch.zeros(len(ALL_MODULES), L, dtype=torch.float32, device=spec.device)
        self.host_ranks: dict[str, list[int]] = {m: [0] * L for m in ALL_MODULES}
        self.host_scalings: dict[str, list[float]] = {m: [0.0] * L for m in ALL_MODULES}
        self.host_adapter_scalings: list[float] = [0.0] * L

    # --- views -------------------------------------------------------------------------------

    @property
    def gate_up_A(self) -> torch.Tensor:
        """[2, L, E, R, H]: A of gate (0) and up (1); expert stride 0 where stored once per slot."""
        return self._views["gate_up_A"]

    @property
    def gate_up_B(self) -> torch.Tensor:
        """[2, L, E, I, R]: B of gate and up; expert stride 0 where stored once per slot."""
        return self._views["gate_up_B"]

    @property
    def down_A(self) -> torch.Tensor:
        """[L, E, R, I]; expert stride 0 where stored once per slot."""
        return self._views["down_A"]

    @property
    def down_B(self) -> torch.Tensor:
        """[L, E, H, R]; expert stride 0 where stored once per slot (shared-outer, fully shared)."""
        return self._views["down_B"]

    def storage(self, factor: str) -> torch.Tensor:
        """The buffer behind ``factor`` (``EXPERT_FACTORS``): expert dim 1 where the layout shares it
        (``gate_up_A`` [2, L, 1, R, H] etc.), else the view itself. Writers use this.

        Raises:
            InvalidFieldError: unknown factor.
        """
        if factor not in self._storage:
            raise InvalidFieldError("factor", f"unknown {factor!r}; expected one of {EXPERT_FACTORS}")
        return self._storage[factor]

    def is_shared(self, factor: str) -> bool:
        """Whether the pool stores ``factor`` once per slot (read with expert stride 0)."""
        self.storage(factor)
        return factor in self.spec.shared_factors

    def slot_bytes(self) -> int:
        """Bytes of one slot over every buffer as stored (a shared factor counted once)."""
        tensors = [*self._storage.values(), *self.dense_A.values(), *self.dense_B.values()]
        return sum(t.numel() * t.element_size() for t in tensors) // self.spec.max_loras

    @property
    def gate_A(self) -> torch.Tensor:
        """[L, E, R, H] view of ``gate_up_A[0]``."""
        return self.gate_up_A[0]

    @property
    def up_A(self) -> torch.Tensor:
        """[L, E, R, H] view of ``gate_up_A[1]``."""
        return self.gate_up_A[1]

    @property
    def gate_B(self) -> torch.Tensor:
        """[L, E, I, R] view of ``gate_up_B[0]``."""
        return self.gate_up_B[0]

    @property
    def up_B(self) -> torch.Tensor:
        """[L, E, I, R] view of ``gate_up_B[1]``."""
        return self.gate_up_B[1]

    def factors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of ``module``: MoE [L, E, R, in] / [L, E, out, R]; dense [L, R, in] / [L, out, R]."""
        if module == "gate":
            return self.gate_A, self.gate_B
        if module == "up":
            return self.up_A, self.up_B
        if module == "down":
            return self.down_A, self.down_B
        if module in self.dense_A:
            return self.dense_A[module], self.dense_B[module]
        raise InvalidFieldError("module", f"{module!r} is not a module of this layer")

    def stored_factors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of ``module`` as stored, for writers: MoE [L, E or 1, R, in] / [L, E or 1, out, R]
        (expert dim 1 where the layout shares the factor; ``factors`` gives the expert-stride-0
        views readers index), dense as ``factors``."""
        if module in MOE_MODULES:
            A, B = self._storage[expert_factor(module, "A")], self._storage[expert_factor(module, "B")]
            if module == "down":
                return A, B
            i = 0 if module == "gate" else 1
            return A[i], B[i]
        return self.factors(module)

    def scalings(self, module: str) -> torch.Tensor:
        """[L] fp32 σ of ``module`` per slot (a view)."""
        return self.module_scalings[module_index(module)]

    def ranks(self, module: str) -> torch.Tensor:
        """[L] int32 rank of ``module`` per slot (a view)."""
        return self.module_ranks[module_index(module)]

    def slot_rank(self, slot: int) -> int:
        """Host: the slot's rank as a scheduler sees it (max over modules; 0 = empty)."""
        self._check_slot(slot)
        return max(self.host_ranks[m][slot] for m in ALL_MODULES)

    def slot_ranks(self) -> tuple[int, ...]:
        """Host: ``slot_rank`` of every slot (``BatchSpec.lora_ranks``)."""
        return tuple(self.slot_rank(s) for s in range(self.spec.max_loras))

    def slot_scalings(self) -> tuple[float, ...]:
        """Host: adapter-level σ of every slot (``BatchSpec.scalings``)."""
        return tuple(self.host_adapter_scalings)

    # --- loading -----------------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.spec.max_loras:
            raise SlotError("slot", f"must be an int in [0, max_loras={self.spec.max_loras}), got {slot!r}")

    def validate(self, slot: int, adapter: Mapping[str, ModuleLoRA]) -> dict[str, ModuleLoRA]:
        """Check that ``adapter`` can be loaded into ``slot`` of this pool, writing nothing.

        The checks of :meth:`load_slot` (which makes them before its first write), for callers
        that must validate several pools before writing any (``checkpoint.load_adapter_into_slot``).
        An empty ``adapter`` only checks the slot.

        Args:
            slot: slot index in ``[0, max_loras)``.
            adapter: module name → ``ModuleLoRA`` (MoE factors [E, r, in] / [E, out, r], dense
                [r, in] / [out, r], any floating dtype).

        Returns:
            The checked modules, module name → ``ModuleLoRA`` (the same objects, in ``adapter``'s order).

        Raises:
            SlotError: slot out of range (checked first).
            InvalidFieldError: ``adapter`` not a mapping; a module not in this layer, not a
                ``ModuleLoRA``, non-floating or meta-device factors, wrong dims or shapes, rank
                outside [1, R], a σ that is not a real number or not finite in fp32, NaN/Inf in a
                factor as given or after the cast to the pool's dtype (field ``adapter[<module>]...``).
        """
        return {m: lora for m, (lora, _, _) in self._checked(slot, adapter).items()}

    def _checked(
        self, slot: int, adapter: Mapping[str, ModuleLoRA]
    ) -> dict[str, tuple[ModuleLoRA, torch.Tensor, torch.Tensor]]:
        """module → (the caller's ModuleLoRA, A and B cast to the pool's dtype, detached)."""
        self._check_slot(slot)
        if not isinstance(adapter, Mapping):
            raise InvalidFieldError("adapter", f"must be a mapping module -> ModuleLoRA, got {type(adapter).__name__}")
        return {m: self._validated_module(m, lora) for m, lora in adapter.items()}

    def _validated_module(self, module: str, lora: ModuleLoRA) -> tuple[ModuleLoRA, torch.Tensor, torch.Tensor]:
        spec = self.spec
        if module not in MOE_MODULES and module not in spec.dense_shapes:
            known = MOE_MODULES + tuple(m for m in DENSE_LORA_MODULES if m in spec.dense_shapes)
            raise InvalidFieldError(f"adapter[{module!r}]", f"not a module of this layer; expected one of {known}")
        if not isinstance(lora, ModuleLoRA):
            raise InvalidFieldError(f"adapter[{module!r}]", f"must be a ModuleLoRA, got {type(lora).__name__}")
        A, B = lora.lora_A, lora.lora_B
        fin, fout = spec.module_shape(module)
        moe = module in MOE_MODULES
        lead = (spec.E,) if moe else ()
        for name, t in (("lora_A", A), ("lora_B", B)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise InvalidFieldError(f"adapter[{module!r}].{name}", "must be a floating-point tensor")
            if t.device.type == "meta":
                raise InvalidFieldError(f"adapter[{module!r}].{name}", "is on the meta device (it holds no values)")
            if t.dim() != len(lead) + 2:
                raise InvalidFieldError(
                    f"adapter[{module!r}].{name}",
                    f"expected {len(lead) + 2} dims ({'[E, r, in]' if name == 'lora_A' else '[E, out, r]'}"
                    f"{' per expert' if moe else ' without E'}), got shape {tuple(t.shape)}",
                )
        r = A.shape[-2]
        want_A, want_B = (*lead, r, fin), (*lead, fout, r)
        if moe:  # expert dim 1: one factor for every expert (shared-outer, fully shared)
            for name, t, factor in (("lora_A", A, "A"), ("lora_B", B, "B")):
                pool_factor = expert_factor(module, factor)
                if t.shape[0] == 1:
                    if name == "lora_A":
                        want_A = (1, *want_A[1:])
                    else:
                        want_B = (1, *want_B[1:])
                elif pool_factor in spec.shared_factors and t.shape[0] == spec.E:
                    raise InvalidFieldError(
                        f"adapter[{module!r}].{name}",
                        f"a per-expert factor {tuple(t.shape)} does not fit this pool, which stores {pool_factor} "
                        f"once per slot (expert_layout={spec.expert_layout!r}); load the adapter into a pool whose "
                        f"layout keeps {pool_factor} per expert")
        if tuple(A.shape) != want_A:
            raise InvalidFieldError(f"adapter[{module!r}].lora_A", f"expected shape {want_A}, got {tuple(A.shape)}")
        if tuple(B.shape) != want_B:
            raise InvalidFieldError(f"adapter[{module!r}].lora_B", f"expected shape {want_B}, got {tuple(B.shape)}")
        if not 1 <= r <= spec.R:
            raise InvalidFieldError(f"adapter[{module!r}].rank", f"rank {r} is outside [1, max_rank={spec.R}]")
        fp32_scaling(f"adapter[{module!r}].scaling", lora.scaling)
        cast = []
        with torch.no_grad():
            for name, t in (("lora_A", A), ("lora_B", B)):
                # Finite as given is not enough: fp32 values above 65504 become Inf in an fp16 pool.
                c = t.detach().to(spec.dtype)
                if not bool(torch.isfinite(c).all()):
                    if not bool(torch.isfinite(t).all()):
                        raise InvalidFieldError(f"adapter[{module!r}].{name}", "holds NaN or Inf")
                    raise InvalidFieldError(
                        f"adapter[{module!r}].{name}",
                        f"overflows the pool's {str(spec.dtype).removeprefix('torch.')} when cast from "
                        f"{str(t.dtype).removeprefix('torch.')} (max |w| = {float(t.detach().abs().max()):.3g})",
                    )
                cast.append(c)
        return lora, cast[0], cast[1]

    def load_slot(
        self, slot: int, adapter: Mapping[str, ModuleLoRA], *, adapter_scaling: float | None = None
    ) -> None:
        """Load one adapter's layer tensors into ``slot``, replacing what was there.

        Ranks below R are zero-padded; modules absent from ``adapter`` are zeroed with rank 0 and
        σ 0. Tensors are cast to the spec's dtype and copied under ``torch.no_grad()`` (the
        caller's tensors and their autograd history are not kept). Everything is validated before
        the first write: on error the slot is unchanged.

        Args:
            slot: slot index in ``[0, max_loras)``.
            adapter: module name ("gate", "up", "down", "q", "k", "v", "o") → ``ModuleLoRA``.
            adapter_scaling: the adapter-level σ reported in ``slot_scalings()`` (an int or float
                that fp32 holds); defaults to the σ of the first present module in ``ALL_MODULES`` order.

        Raises:
            SlotError: slot out of range.
            InvalidFieldError: everything :meth:`validate` refuses; an empty adapter; a bad
                ``adapter_scaling`` (field ``adapter_scaling``).
        """
        checked = self._checked(slot, adapter)
        if not checked:
            raise InvalidFieldError("adapter", "has no modules; use clear_slot to empty a slot")
        if adapter_scaling is None:
            adapter_scaling = next(checked[m][0].scaling for m in ALL_MODULES if m in checked)
        adapter_scaling = fp32_scaling("adapter_scaling", adapter_scaling)
        self.clear_slot(slot)
        with torch.no_grad():
            for module, (lora, cast_A, cast_B) in checked.items():
                A, B = self.stored_factors(module)
                r = lora.rank
                sigma = float(lora.scaling)
                # [1, r, in] into an [E, R, in] buffer broadcasts (the per-expert layout has no
                # single copy to keep); into a [1, R, in] buffer it is stored once.
                A[slot, ..., :r, :].copy_(cast_A)
                B[slot, ..., :, :r].copy_(cast_B)
                idx = module_index(module)
                self.module_ranks[idx, slot] = r
                self.module_scalings[idx, slot] = sigma
                self.host_ranks[module][slot] = r
                self.host_scalings[module][slot] = sigma
        self.host_adapter_scalings[slot] = adapter_scaling

    def clear_slot(self, slot: int) -> None:
        """Zero every module of ``slot`` (rank 0, σ 0).

        Raises:
            SlotError: slot out of range.
        """
        self._check_slot(slot)
        with torch.no_grad():
            for t in (self._storage["gate_up_A"], self._storage["gate_up_B"]):
                t[:, slot].zero_()
            for t in (self._storage["down_A"], self._storage["down_B"], *self.dense_A.values(),
                      *self.dense_B.values()):
                t[slot].zero_()
            self.module_ranks[:, slot] = 0
            self.module_scalings[:, slot] = 0.0
        for m in ALL_MODULES:
            self.host_ranks[m][slot] = 0
            self.host_scalings[m][slot] = 0.0
        self.host_adapter_scalings[slot] = 0.0
