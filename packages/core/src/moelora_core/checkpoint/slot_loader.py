"""Load one adapter into one slot of every layer's pool, atomically.

A model has one ``LoRAWeights`` pool per decoder layer. :func:`load_adapter_into_slot` validates the
adapter against every pool (layer count, module shapes, rank <= R, σ and ``adapter_scaling`` as fp32
values, factors finite after the cast to each pool's dtype) before it writes or clears the first
layer, so a refusal leaves every slot of every pool exactly as it was. Layers the adapter does
not touch are cleared in that slot (rank 0, σ 0): a slot holds one adapter, never leftovers of the
previous one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelora_core.adapter_config import fp32_scaling
from moelora_core.checkpoint.adapter_reader import AdapterWeights
from moelora_core.checkpoint.errors import (
    ExpertLayoutError,
    ModelMismatchError,
    NonFiniteWeightError,
    RankTooLargeError,
    ShapeMismatchError,
)
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import MOE_MODULES, LoRALayerSpec, expert_factor
from moelora_core.weights import LoRAWeights, ModuleLoRA


def load_adapter_into_slot(
    pools: Sequence[LoRAWeights], slot: int, adapter: AdapterWeights, *, adapter_scaling: float | None = None
) -> None:
    """Write ``adapter`` into ``slot`` of ``pools[l]`` for every layer l, or change nothing.

    Args:
        pools: one pool per decoder layer, in layer order.
        slot: the adapter slot, in ``[0, max_loras)`` of every pool.
        adapter: from :func:`~moelora_core.checkpoint.read_adapter` (for the same model).
        adapter_scaling: the adapter-level σ recorded in each pool (``slot_scalings()``), an int or
            float that fp32 holds; defaults to :meth:`AdapterWeights.scaling`.

    Raises:
        SlotError: ``slot`` outside a pool's range.
        ModelMismatchError: the pools are for another model (layer count, a module absent from the
            pool's spec, other dims).
        RankTooLargeError: a module's rank above a pool's max rank R.
        ShapeMismatchError: a factor's shape the pool refuses.
        ExpertLayoutError: a per-expert factor for a buffer the pool's ``expert_layout`` stores once
            per slot (a factor with expert count 1 fits every pool: broadcast where kept per expert).
        NonFiniteWeightError: NaN or Inf in a factor, as given or after the cast to a pool's dtype
            (the class the reader raises for the same fault).
        InvalidFieldError: a bad ``adapter_scaling`` (field ``adapter_scaling``); factors that are not
            tensors of the module's dims; anything else ``LoRAWeights.load_slot`` would refuse (σ not
            finite in fp32, ...), named by adapter and layer.
    """
    name = adapter.name
    if len(pools) != adapter.num_layers:
        raise ModelMismatchError(name, "pools", "one pool per decoder layer is needed",
                                 expected=adapter.num_layers, found=len(pools))
    # Checked before any layer is cleared: a layer without modules is cleared in the write loop.
    if adapter_scaling is not None:
        adapter_scaling = fp32_scaling("adapter_scaling", adapter_scaling)
    for layer, (pool, modules) in enumerate(zip(pools, adapter.layers)):
        pool.validate(slot, {})  # the slot alone: SlotError before anything is written
        spec = pool.spec
        for module, lora in modules.items():
            where = f"layer {layer} {module}"
            if module not in MOE_MODULES and module not in spec.dense_shapes:
                raise ModelMismatchError(name, where, "the pool's layer spec has no such module",
                                         expected=f"one of {MOE_MODULES + tuple(spec.dense_shapes)}", found=module)
            fin, fout = spec.module_shape(module)
            lead = (spec.E,) if module in MOE_MODULES else ()
            _check_factor_dims(name, where, lora, len(lead) + 2)
            r = lora.rank
            if r > spec.R:
                raise RankTooLargeError(name, where, "rank above the pool's max rank", expected=f"<= {spec.R}", found=r)
            want_a, want_b = (*lead, r, fin), (*lead, fout, r)
            got_a, got_b = tuple(lora.lora_A.shape), tuple(lora.lora_B.shape)
            if lead:  # expert count 1: a factor shared by every expert (the pool checks where it fits)
                want_a = (1, *want_a[1:]) if got_a[:1] == (1,) else want_a
                want_b = (1, *want_b[1:]) if got_b[:1] == (1,) else want_b
            if (got_a, got_b) != (want_a, want_b):
                kind = ModelMismatchError if (got_a[-1], got_b[-2]) != (fin, fout) or \
                    got_a[:-2] not in (lead, (1,)[:len(lead)]) else ShapeMismatchError
                raise kind(name, where, "factors do not fit the pool's layer spec",
                           expected=f"A {want_a}, B {want_b}", found=f"A {got_a}, B {got_b}")
            if lead:
                refuse_layout_mismatch(spec, adapter, layer, module, lora)
            try:
                pool.validate(slot, {module: lora})  # the pool's own checks (finiteness, σ), still before any write
            except InvalidFieldError as exc:
                part = exc.field.removeprefix(f"adapter[{module!r}]").lstrip(".")  # "scaling", "lora_B", ...
                if part in ("lora_A", "lora_B"):  # NaN / Inf, or an overflow in the cast: as the reader says it
                    raise NonFiniteWeightError(name, f"{where} {part}", exc.problem) from None
                field = f"adapter {name!r} {where}" + (f" {part}" if part else "")
                raise InvalidFieldError(field, exc.problem) from None
    if adapter_scaling is None:  # the modules' σ were checked above, so this one fits fp32 too
        adapter_scaling = fp32_scaling("adapter_scaling", adapter.scaling())
    # Everything fits every pool: write. load_slot re-validates and cannot fail now.
    for pool, modules in zip(pools, adapter.layers):
        if modules:
            pool.load_slot(slot, dict(modules), adapter_scaling=adapter_scaling)
        else:
            pool.clear_slot(slot)


def refuse_layout_mismatch(spec: LoRALayerSpec, adapter: AdapterWeights, layer: int, module: str,
                           lora: ModuleLoRA) -> None:
    """Refuse a per-expert factor of MoE ``module`` for a buffer ``spec``'s expert layout stores once
    per slot (a factor with expert count 1 fits either kind of buffer).

    Raises:
        ExpertLayoutError: naming the adapter, layer, module, factor, the pool's layout and the
            adapter's.
    """
    if spec.E == 1:
        return
    for factor, t in (("A", lora.lora_A), ("B", lora.lora_B)):
        buffer = expert_factor(module, factor)
        if t.shape[0] != 1 and buffer in spec.shared_factors:
            raise ExpertLayoutError(
                adapter.name, f"layer {layer} {module} lora_{factor}", f"a per-expert factor does not fit a pool "
                f"that stores {buffer} once per slot (expert_layout={spec.expert_layout!r}); this adapter's "
                f"layout is {adapter.expert_layout!r}: serve it with expert_layout='per_expert' (or one it fits)",
                expected=f"{buffer} with expert count 1", found=f"expert count {t.shape[0]}")


def _check_factor_dims(name: str, where: str, lora: object, dims: int) -> None:
    """A hand-built adapter's factors must be tensors of the module's dims before shapes are compared."""
    if not isinstance(lora, ModuleLoRA):
        raise InvalidFieldError(f"adapter {name!r} {where}", f"must be a ModuleLoRA, got {type(lora).__name__}")
    for factor, t in (("lora_A", lora.lora_A), ("lora_B", lora.lora_B)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            found = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidFieldError(f"adapter {name!r} {where} {factor}",
                                    f"expected a tensor of {dims} dims, got {found}")
