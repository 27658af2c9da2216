"""The engine's choice of base MoE path (``--moe-impl torch|triton``), in the signature of
``moelora_core.moe_deltas.BaseMoEPath``.

- ``torch``: ``moelora_reference.base_moe.moe_forward`` (gathers + batched mat-vecs; fp32
  intermediates, y rounded once to the model dtype).
- ``triton``: ``moelora_kernels.fused_moe`` (the base fused-MoE kernels; intermediates rounded to
  the model dtype, as the kernels store them). Imported on first use, so a CPU run on the torch
  path never imports Triton (and ``TRITON_INTERPRET`` only has to be set for the Triton path).

Both are the project's one MoE forward (DESIGN.md §6); this module only adapts the Triton one's
signature. A backend that declares ``fused_moe`` (the reference backend) runs its own
``moe_forward`` instead, whatever is chosen here: ``moe_layer_forward`` decides.
"""

from __future__ import annotations

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.moe_deltas import BaseMoEPath, MoEDeltas
from moelora_reference import base_moe

#: The base paths, by ``--moe-impl`` name.
MOE_IMPLS: tuple[str, ...] = ("torch", "triton")


def triton_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, base: MoEBaseWeights,
                       *, deltas: MoEDeltas | None = None) -> torch.Tensor:
    """``moelora_kernels.fused_moe`` in the base-path signature: y [T, H] in x's dtype.

    Args:
        x: [T, H]. topk_ids: [T, k] int32. topk_weights: [T, k] fp32. base: weights in x's dtype.
        deltas: the backend's MoE deltas, or None.
    """
    from moelora_kernels import fused_moe

    act = base.activation  # GPT-OSS: swiglu_oai and expert biases, in the halves layout the readers give
    return fused_moe(x, topk_ids.contiguous(), topk_weights.contiguous(), base.w_gate_up, base.w_down, deltas=deltas,
                     activation=act.kind, alpha=act.alpha, limit=act.limit, b_gate_up=base.b_gate_up,
                     b_down=base.b_down, weight_block=base.weight_block,  # fp8 experts: w8a8 (DESIGN.md §1)
                     w_gate_up_scale_inv=base.w_gate_up_scale_inv, w_down_scale_inv=base.w_down_scale_inv)


def base_moe_path(impl: str) -> BaseMoEPath:
    """The base path called ``impl`` ("torch" or "triton").

    Raises:
        ValueError: another name.
    """
    if impl == "torch":
        return base_moe.moe_forward
    if impl == "triton":
        return triton_moe_forward
    raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
