"""The dense shared expert of a Qwen2-MoE or DeepSeek-V3 block, beside the routed experts, and
DeepSeek-V3's dense first-layer MLP: one dense SwiGLU with LoRA on its three projections (DESIGN.md §1).

transformers 5.17 ``Qwen2MoeSparseMoeBlock.forward`` computes, for every token x [H]:

    s = W_down (silu(W_gate x) ⊙ (W_up x))        the shared expert, a SwiGLU MLP of width Is
    y = routed_moe(x) + sigmoid(w_sg · x) · s     w_sg [1, H]: ``mlp.shared_expert_gate``

Every token goes through the shared expert (no routing), so its three projections are *dense*
modules: LoRA on ``mlp.shared_expert.{gate,up,down}_proj`` is σ·B(A x) on each projection's input,
added through ``Backend.dense_delta`` under the module names ``shared_gate``, ``shared_up``,
``shared_down`` (``moelora_core.layer_spec.SHARED_EXPERT_MODULES``), exactly like q/k/v/o. The
sigmoid gate has no LoRA (the adapter readers refuse LoRA on it).

DeepSeek-V3 (transformers ``DeepseekV3MoE``): the shared experts are one SwiGLU of width
``moe_intermediate_size · n_shared_experts`` with **no gate** (``gate`` None: ``y = routed(x) + s``),
modules ``shared_gate`` / ``shared_up`` / ``shared_down``; its dense first layers
(``DeepseekV3MLP``, ``mlp.{gate,up,down}_proj``) are the same SwiGLU without a gate, under the module
names ``dense_gate`` / ``dense_up`` / ``dense_down`` (:func:`dense_mlp`).

:func:`shared_expert_forward` is the one place the shared expert's sequence is written for the
serving paths (the engine's decoder layer); the oracle has its own float64 twin
(``moelora_reference.oracle.shared_expert_forward``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import DENSE_MLP_MODULES, SHARED_EXPERT_MODULES


@dataclass
class SharedExpertWeights:
    """The base weights of one layer's shared expert.

    Attributes:
        gate_proj: [Is, H] (``mlp.shared_expert.gate_proj.weight``).
        up_proj: [Is, H] (``mlp.shared_expert.up_proj.weight``).
        down_proj: [H, Is] (``mlp.shared_expert.down_proj.weight``).
        gate: [1, H] the sigmoid gate (``mlp.shared_expert_gate.weight``), or None (DeepSeek-V3's
            shared experts and dense MLPs have none).
        modules: the moelora module names of (gate_proj, up_proj, down_proj): the shared expert's
            (``SHARED_EXPERT_MODULES``) or a dense MLP's (``DENSE_MLP_MODULES``).

    Raises:
        InvalidFieldError: shapes that do not fit one another.
    """

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate: torch.Tensor | None = None
    modules: tuple[str, str, str] = SHARED_EXPERT_MODULES

    def __post_init__(self) -> None:
        if self.gate_proj.dim() != 2:
            raise InvalidFieldError("gate_proj", f"expected [Is, H], got {tuple(self.gate_proj.shape)}")
        si, h = self.gate_proj.shape
        for name, want in (("up_proj", (si, h)), ("down_proj", (h, si)), ("gate", (1, h))):
            if getattr(self, name) is None and name == "gate":
                continue
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise InvalidFieldError(name, f"expected {want}, got {got}")

    @property
    def intermediate_size(self) -> int:
        """Is, the shared expert's width."""
        return self.gate_proj.shape[0]

    def dense(self, module: str) -> torch.Tensor:
        """The [out, in] weight of ``module`` (one of ``modules``: "shared_gate", "shared_up",
        "shared_down", or a dense MLP's "dense_gate", "dense_up", "dense_down").

        Raises:
            InvalidFieldError: another module name.
        """
        weights = dict(zip(self.modules, (self.gate_proj, self.up_proj, self.down_proj)))
        if module not in weights:
            raise InvalidFieldError("module", f"{module!r} is not a module of this MLP; expected one of "
                                              f"{tuple(weights)}")
        return weights[module]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SharedExpertWeights:
        """The same weights with ``fn`` applied to each tensor (e.g. a move to a device and dtype)."""
        return SharedExpertWeights(fn(self.gate_proj), fn(self.up_proj), fn(self.down_proj),
                                   None if self.gate is None else fn(self.gate), self.modules)


def dense_mlp(gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> SharedExpertWeights:
    """DeepSeek-V3's dense first-layer MLP (``mlp.{gate,up,down}_proj``: [Id, H], [Id, H], [H, Id]) as
    an ungated SwiGLU whose modules are "dense_gate", "dense_up", "dense_down"."""
    return SharedExpertWeights(gate_proj, up_proj, down_proj, None, DENSE_MLP_MODULES)


#: A dense projection with its LoRA: ``project(module, x [T, in]) -> [T, out]`` (base GEMM + delta).
DenseProjection = Callable[[str, torch.Tensor], torch.Tensor]


def shared_expert_forward(x: torch.Tensor, weights: SharedExpertWeights, project: DenseProjection) -> torch.Tensor:
    """sigmoid(x w_sgᵀ) · shared_down(silu(shared_gate(x)) ⊙ shared_up(x)) for every row of ``x``
    (without the sigmoid factor when ``weights.gate`` is None; a dense MLP's module names when
    ``weights.modules`` are ``DENSE_MLP_MODULES``).

    Args:
        x: [T, H] the MoE block's input (after the post-attention norm), the model dtype.
        weights: the layer's shared expert.
        project: the caller's dense path (its base GEMM plus ``Backend.dense_delta`` for the module),
            called for "shared_gate", "shared_up" (input x) and "shared_down" (input the activated
            [T, Is]), in that order.

    Returns:
        [T, H] in x's dtype: the term the block adds to the routed experts' output. Rounding follows
        transformers: each projection, the activation product and the gate product in x's dtype.
    """
    gate, up, down = weights.modules
    g = project(gate, x)
    u = project(up, x)
    s = project(down, F.silu(g) * u)
    return s if weights.gate is None else torch.sigmoid(F.linear(x, weights.gate)) * s
