"""The operands of the MoE-LoRA expand taken inside a base grouped GEMM's epilogue (DESIGN.md §6,
"the deltas inside the base GEMM"), shared by the Triton kernel (``moelora_kernels.fused_moe``) and
its readable twin (``moelora_reference.fused_moe``).

The shrink runs first as its own pass (``fused_moe_lora_shrink``: t = A·x per pair, written once);
the base GEMM over the base alignment (blocks by expert only, so each expert's W is read once) then
adds, for each of its rows p of slot l = ``token_lora_mapping[p // top_k]`` and each column c of
slice s (``c // N_s``)::

    C[p, c] = w_p · (W[e] a[p] + B[s, l, e, c - s·N_s, :] · (σ[s, l] · t[s, p, :]))

where the slot is enabled, its rank of slice s is > 0 and e < E_lora (σ · t rounded once to t's dtype,
the product accumulated in fp32 with the base, the sum rounded once; in fp16, σ · t must fit its range).
Every other row (no adapter, a disabled slot, a module the adapter lacks, an expert without LoRA) keeps
the base value bit for bit, given finite factors (the adapter reader refuses NaN and Inf; a non-finite
factor would reach the other rows of its block, since one product serves the block's rows of every
slot). gate_up: S = 2 slices (gate, up) of N_s = I; down: S = 1, N_s = H, the delta joins before the
router weight (DESIGN.md §1). Against the separate expand this saves the
read + write of every adapter row of the GEMM's output (the round trip that bounds a separate delta
pass at large M, benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from moelora_core.moe_deltas import MoEDeltas


@dataclass(frozen=True)
class GemmLoRA:
    """The expand operands of one stage for a base GEMM's epilogue (module docstring).

    Attributes:
        intermediate: [S, M·top_k, R] t from the shrink, in the GEMM input's dtype; read at every row
            of an enabled slot of the token map (zero the rows the shrink's alignment leaves out).
        lora_b: [S, L, E_lora, N_s, R] B factors (``gate_up_B`` / ``down_B[None]``), same dtype,
            last stride 1.
        ranks: [S, L] int32 rank per slice and slot (0 = the module is absent).
        scalings: [S, L] fp32 σ per slice and slot.
        token_lora_mapping: [M] int32 slot per token; -1 (any value outside [0, L)) = no adapter.
        top_k: experts per token (pair p belongs to token p // top_k).
        max_rank: host bound on every active rank (<= R): the tile's rank width; a device rank above it
            is read as it.
        adapter_enabled: [L] int32 (0 = disabled) or None (all enabled).
    """

    intermediate: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    token_lora_mapping: torch.Tensor
    top_k: int
    max_rank: int
    adapter_enabled: torch.Tensor | None = None


@runtime_checkable
class GemmLoRADeltas(MoEDeltas, Protocol):
    """A :class:`~moelora_core.moe_deltas.MoEDeltas` that may hand a stage's expand to the base GEMM.

    The Triton base path (``moelora_kernels.fused_moe``) asks before each bf16 / fp16 / fp32 base GEMM;
    where ``gemm_lora`` returns operands the GEMM adds the delta in its epilogue and the stage's
    ``gate_up`` / ``down`` method is not called, where it returns None the method is (the torch base
    path and the w8a8 GEMM never ask).
    """

    def gemm_lora(self, stage: str, inp: torch.Tensor, topk_ids: torch.Tensor) -> GemmLoRA | None:
        """The operands of ``stage`` ("gate_up": ``inp`` = x [T, H]; "down": h [T·k, I]), or None.

        Runs the stage's shrink; the expand is left to the GEMM.
        """
        ...
