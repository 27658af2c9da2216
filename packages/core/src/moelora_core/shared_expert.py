"""The dense shared expert of a Qwen2-MoE block, beside the routed experts (DESIGN.md §1).

transformers 5.17 ``Qwen2MoeSparseMoeBlock.forward`` computes, for every token x [H]:

    s = W_down (silu(W_gate x) ⊙ (W_up x))        the shared expert, a SwiGLU MLP of width Is
    y = routed_moe(x) + sigmoid(w_sg · x) · s     w_sg [1, H]: ``mlp.shared_expert_gate``

Every token goes through the shared expert (no routing), so its three projections are *dense*
modules: LoRA on ``mlp.shared_expert.{gate,up,down}_proj`` is σ·B(A x) on each projection's input,
added through ``Backend.dense_delta`` under the module names ``shared_gate``, ``shared_up``,
``shared_down`` (``moelora_core.layer_spec.SHARED_EXPERT_MODULES``), exactly like q/k/v/o. The
sigmoid gate has no LoRA (the adapter readers refuse LoRA on it).

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


@dataclass
class SharedExpertWeights:
    """The base weights of one layer's shared expert.

    Attributes:
        gate_proj: [Is, H] (``mlp.shared_expert.gate_proj.weight``).
        up_proj: [Is, H] (``mlp.shared_expert.up_proj.weight``).
        down_proj: [H, Is] (``mlp.shared_expert.down_proj.weight``).
        gate: [1, H] the sigmoid gate (``mlp.shared_expert_gate.weight``).

    Raises:
        InvalidFieldError: shapes that do not fit one another.
    """

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate: torch.Tensor

    def __post_init__(self) -> None:
        if self.gate_proj.dim() != 2:
            raise InvalidFieldError("gate_proj", f"expected [Is, H], got {tuple(self.gate_proj.shape)}")
        si, h = self.gate_proj.shape
        for name, want in (("up_proj", (si, h)), ("down_proj", (h, si)), ("gate", (1, h))):
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise InvalidFieldError(name, f"expected {want}, got {got}")

    @property
    def intermediate_size(self) -> int:
        """Is, the shared expert's width."""
        return self.gate_proj.shape[0]

    def dense(self, module: str) -> torch.Tensor:
        """The [out, in] weight of ``module`` ("shared_gate", "shared_up" or "shared_down").

        Raises:
            InvalidFieldError: another module name.
        """
        weights = {"shared_gate": self.gate_proj, "shared_up": self.up_proj, "shared_down": self.down_proj}
        if module not in weights:
            raise InvalidFieldError("module", f"{module!r} is not a shared-expert module; expected one of "
                                              f"{tuple(weights)}")
        return weights[module]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SharedExpertWeights:
        """The same weights with ``fn`` applied to each tensor (e.g. a move to a device and dtype)."""
        return SharedExpertWeights(fn(self.gate_proj), fn(self.up_proj), fn(self.down_proj), fn(self.gate))


#: A dense projection with its LoRA: ``project(module, x [T, in]) -> [T, out]`` (base GEMM + delta).
DenseProjection = Callable[[str, torch.Tensor], torch.Tensor]


def shared_expert_forward(x: torch.Tensor, weights: SharedExpertWeights, project: DenseProjection) -> torch.Tensor:
    """sigmoid(x w_sgᵀ) · shared_down(silu(shared_gate(x)) ⊙ shared_up(x)) for every row of ``x``.

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
    g = project("shared_gate", x)
    u = project("shared_up", x)
    s = project("shared_down", F.silu(g) * u)
    return torch.sigmoid(F.linear(x, weights.gate)) * s
