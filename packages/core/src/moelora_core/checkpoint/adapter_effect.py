"""Whether an adapter changes anything: no-op modules and no-op adapters, named at load.

A no-op adapter is a valid file and is served; but every check run with it proves only the base
model (peft's default ``init_lora_weights=True`` saves lora_B = 0: such an adapter passes every
comparison with HF + PEFT). So the engine, the ``moelora`` command and the suite name it with a
warning when it is loaded, and the suite reports claims that relied only on no-op adapters as
"not meaningful" (``conformance/docs/suite.md``).

A module of an adapter (one layer's q, k, v, o, gate, up, down, shared_gate, shared_up or
shared_down) is a **no-op** when

- every element of its lora_B is exactly zero, or every element of its lora_A (all experts), or
- its ``delta_rel`` on a probe is below the tolerance row of the compute dtype
  (``DEFAULT_POLICY.lookup(dtype, device).rms_rel``: 1e-5 in fp32, 1e-3 in fp16, 8e-3 in bf16): the
  probe is :data:`PROBE_ROWS` rows X ~ N(0, 1) of the module's input width drawn from a generator
  seeded :data:`PROBE_SEED` (the same rows for every module of that width), and
  ``delta_rel = ‖σ·B(A Xᵀ)‖ / ‖W Xᵀ‖`` over the probe rows (and every routed expert of a MoE module,
  shared factors broadcast), W the module's base weight (MoE: ``w_gate_up``'s gate / up rows,
  ``w_down``). A delta that small is within the tolerance every output comparison allows, so no
  comparison could tell the adapter from the base model.

The probe needs the base weights; without them (``base=None``) only the exact-zero tests apply and
``delta_rel`` is None. An adapter is a no-op when every module it holds is (an adapter with no
module at all is one too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelora_core.fp8_block import dequantize_weight
from moelora_core.layer_spec import ALL_MODULES
from moelora_core.tolerance import DEFAULT_POLICY, Tolerance

#: Rows of the probe (per module).
PROBE_ROWS = 32
#: Seed of the probe's generator.
PROBE_SEED = 0
_MOE = ("gate", "up", "down")


class AdapterWarning(UserWarning):
    """An adapter that is served but changes less than its files suggest: a no-op adapter (or module),
    or ``target_modules`` entries that matched no module (issued at load by ``moelora_runner.Engine``)."""


@dataclass(frozen=True)
class ModuleEffect:
    """One module of one layer of an adapter.

    Attributes:
        layer, module: where it is ("q", "gate", "shared_down", ...).
        rank, scaling: its r and σ.
        delta_rel: ``‖σ·B A X‖ / ‖W X‖`` on the probe (module doc), or None (not measured: no base
            weights, or a factor exactly zero).
        noop: why it is a no-op ("lora_B is exactly zero", "delta_rel 3.1e-09 on the probe is below the
            fp32-ieee tolerance 1e-05"), or "" when it changes its output.
    """

    layer: int
    module: str
    rank: int
    scaling: float
    delta_rel: float | None
    noop: str


@dataclass(frozen=True)
class AdapterEffect:
    """Every module's :class:`ModuleEffect` of one adapter, and the verdict.

    Attributes:
        name: the adapter's name. modules: per layer and module, in layer then ``ALL_MODULES`` order.
        tolerance: the tolerance row the probe was held to. probed: whether base weights were given.
        notes: the reader's notes on the config (``PeftAdapterConfig.notes``).
    """

    name: str
    modules: tuple[ModuleEffect, ...]
    tolerance: Tolerance
    probed: bool
    notes: tuple[str, ...] = ()

    @property
    def noop(self) -> bool:
        """Every module it holds is a no-op (the adapter changes no output within the tolerance)."""
        return all(m.noop for m in self.modules)

    def noop_modules(self) -> tuple[ModuleEffect, ...]:
        return tuple(m for m in self.modules if m.noop)

    def reason(self) -> str:
        """Why the adapter is a no-op, in one phrase ("" when it is not): the reasons its modules give,
        each with the count of modules that give it."""
        if not self.noop:
            return ""
        if not self.modules:
            return "it holds no module"
        counts: dict[str, int] = {}
        for m in self.modules:
            key = m.noop if m.delta_rel is None else f"delta_rel below the {self.tolerance.name} tolerance " \
                                                     f"{self.tolerance.rms_rel:.0e} on the probe"
            counts[key] = counts.get(key, 0) + 1
        return "; ".join(f"{why} ({n} of {len(self.modules)} modules)" for why, n in counts.items())

    def warnings(self) -> tuple[str, ...]:
        """What to tell the user at load, one sentence each (empty for an adapter that changes every module)."""
        out = [f"adapter {self.name!r}: {note}" for note in self.notes]
        if self.noop:
            hint = " (peft's default init_lora_weights=True saves lora_B = 0)" if any(
                "lora_B is exactly zero" in m.noop for m in self.modules) else ""
            out.append(f"adapter {self.name!r} is a no-op: {self.reason()}{hint}; it is served, but it changes no "
                       "output, so a check run with it proves only the base model")
        elif self.noop_modules():
            shown = ", ".join(f"L{m.layer} {m.module}" for m in self.noop_modules()[:6])
            more = len(self.noop_modules()) - 6
            out.append(f"adapter {self.name!r}: {len(self.noop_modules())} of {len(self.modules)} modules add nothing "
                       f"({shown}{f', +{more} more' if more > 0 else ''}): {self.noop_modules()[0].noop}")
        return tuple(out)


def _base_weight(layer, module: str) -> torch.Tensor:
    """[E, out, in] (MoE: the routed experts only) or [out, in] of ``module`` in ``layer`` (a
    ``DecoderLayerWeights``)."""
    if module not in _MOE:
        w = layer.dense(module)
        scale = getattr(layer, "dense_scales", {}).get(module)
        return w if scale is None else dequantize_weight(w, scale, layer.weight_block)
    moe = layer.moe
    E, inter = moe.num_experts, moe.w_down.shape[-1]
    if moe.weight_block is not None:  # fp8 block-scaled experts: the probe multiplies the dequantized weight
        if module == "down":
            return dequantize_weight(moe.w_down[:E], moe.w_down_scale_inv[:E], moe.weight_block)
        w = dequantize_weight(moe.w_gate_up[:E], moe.w_gate_up_scale_inv[:E], moe.weight_block, inter)
        return w[:, :inter] if module == "gate" else w[:, inter:]
    if module == "down":
        return moe.w_down[:E]
    return moe.w_gate_up[:E, :inter] if module == "gate" else moe.w_gate_up[:E, inter:]


def _delta_rel(lora, weight: torch.Tensor, probe: torch.Tensor) -> float:
    """‖σ·B(A Xᵀ)‖ / ‖W Xᵀ‖ over the probe rows (and experts), on the weight's device: the delta in
    fp32, the base product in the weight's dtype (no fp32 copy of a model's expert stack)."""
    dev = weight.device
    x = probe.to(dev)
    a, b = lora.lora_A.to(dev, torch.float32), lora.lora_B.to(dev, torch.float32)
    xw = x.to(weight.dtype)
    if weight.dim() == 2:
        delta = (x @ a.T) @ b.T * float(lora.scaling)
        base = (xw @ weight.T).float()
    else:
        delta = torch.matmul(torch.matmul(x, a.transpose(-1, -2)), b.transpose(-1, -2)) * float(lora.scaling)
        base = torch.matmul(xw, weight.transpose(-1, -2)).float()
        delta = delta.expand(base.shape)  # a factor shared by every expert acts on each of them
    return float(delta.norm() / base.norm().clamp_min(torch.finfo(torch.float32).tiny))


def adapter_effect(adapter, base: Sequence | None = None, *, dtype: torch.dtype | None = None,
                   device: torch.device | str = "cpu") -> AdapterEffect:
    """The :class:`AdapterEffect` of an adapter (module doc).

    Args:
        adapter: ``AdapterWeights`` (``read_adapter``), whole (not a tensor-parallel shard).
        base: the model's ``DecoderLayerWeights`` per layer (whole, any device), or None: exact-zero
            tests only.
        dtype: the compute dtype whose tolerance row the probe is held to (default the adapter's).
        device: the device of that tolerance row.

    Raises:
        KeyError: the tolerance policy has no row for ``dtype``.
    """
    tol = DEFAULT_POLICY.lookup(dtype or adapter.dtype, device)
    probes: dict[int, torch.Tensor] = {}
    modules: list[ModuleEffect] = []
    for li, layer in enumerate(adapter.layers):
        for module in (m for m in ALL_MODULES if m in layer):
            lora = layer[module]
            delta, why = None, ""
            if not bool(lora.lora_B.any()):
                why = "lora_B is exactly zero"
            elif not bool(lora.lora_A.any()):
                why = "lora_A is exactly zero"
            elif base is not None:
                width = int(lora.lora_A.shape[-1])
                if width not in probes:
                    gen = torch.Generator().manual_seed(PROBE_SEED)
                    probes[width] = torch.randn(PROBE_ROWS, width, generator=gen, dtype=torch.float32)
                delta = _delta_rel(lora, _base_weight(base[li], module), probes[width])
                if delta < tol.rms_rel:
                    why = f"delta_rel {delta:.1e} on the probe is below the {tol.name} tolerance {tol.rms_rel:.0e}"
            modules.append(ModuleEffect(li, module, lora.rank, float(lora.scaling), delta, why))
    return AdapterEffect(adapter.name, tuple(modules), tol, base is not None, tuple(adapter.config.notes))
