"""The base fused MoE layer on the Triton kernels, with the MoE-LoRA deltas where the engine adds them.

One of the two places the MoE sequence is written (DESIGN.md §6; the other is
``moelora_reference.base_moe.moe_forward``): LoRA enters through ``deltas=``, any
:class:`moelora_core.moe_deltas.MoEDeltas` (``BackendMoEDeltas`` for a ``Backend``;
:class:`MoELoRAInputs` for the raw kernels).

Steps (each a kernel of this package; no host sync; every intermediate allocated from host shapes):

1. base alignment of ``topk_ids`` over E_base experts (:func:`.align.moe_align_block_size`);
2. gate_up GEMM over aligned pairs → ``gate_up_out`` [M, top_k, 2I] (:func:`.fused_moe.fused_moe_gemm`);
3. optional ``deltas.gate_up``: the MoE-LoRA gate_up delta added before the activation;
4. SiLU-gated (or non-gated, or GPT-OSS's swiglu_oai)
   activation → h [M·top_k, I] (:func:`.moe_epilogue.moe_activation`);
5. down GEMM with the router weight → ``down_out`` [M, top_k, H];
6. optional ``deltas.down``: the MoE-LoRA down delta (router-weighted);
7. top-k sum over pairs with an expert id >= 0 → y [M, H] (:func:`.moe_epilogue.moe_sum`).

With fp8 block-scaled experts (``weight_block``, DESIGN.md §1) steps 2 and 5 are w8a8
(:mod:`.fp8_block`: the GEMM's input quantized per token per K-group, then the fp8 grouped GEMM), and
steps 3 and 6 still read the unquantized x and h.

Expert ids < 0 contribute nothing; ids in [E, E_base) are base experts without LoRA. A token
with no adapter runs exactly the same base kernels with or without LoRA: its rows are never
touched by the delta kernels, so its output is bitwise the LoRA-disabled output.
Rounding points: gate_up_out, h, down_out (each rounded once to x's dtype), y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_core.align import AlignOutput
from moelora_core.errors import KernelPreconditionError
from moelora_core.fp8_block import FP8_DTYPE
from moelora_core.moe_deltas import MoEDeltas
from moelora_core.weights import LoRAWeights
from moelora_kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from moelora_kernels.align import moe_align_block_size
from moelora_kernels.configs import base_moe_block_m
from moelora_kernels.fp8_block import fp8_moe_gemm, quantize_activation_fp8
from moelora_kernels.fused_moe import fused_moe_gemm
from moelora_kernels.moe_epilogue import moe_activation, moe_sum
from moelora_kernels.moe_lora import moe_lora_delta


@dataclass
class MoELoRAInputs:
    """The raw kernels' MoE deltas (a :class:`~moelora_core.moe_deltas.MoEDeltas`): the MoE-LoRA
    kernel :func:`.moe_lora.moe_lora_delta` on a precomputed alignment, for :func:`fused_moe`.

    Attributes:
        weights: the adapter pool of the layer.
        align: ``moe_lora_align_block_size`` output for this batch (per slot).
        adapter_enabled: [L] int32 or None.
        max_rank: host bound on active ranks (None = R).
        fused: shrink+expand in one kernel per stage (True), two (False), or by size (None:
            the config table's choice).
        tf32: TF32 dots for fp32.
    """

    weights: LoRAWeights
    align: AlignOutput
    adapter_enabled: torch.Tensor | None = None
    max_rank: int | None = None
    fused: bool | None = None
    tf32: bool = False

    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor) -> None:
        """gate_up_out [M, top_k, 2I] += the gate and up deltas of x [M, H]."""
        moe_lora_delta("gate_up", x, gate_up_out, self.weights, self.align, top_k=topk_ids.shape[1],
                       adapter_enabled=self.adapter_enabled, max_rank=self.max_rank, fused=self.fused,
                       tf32=self.tf32)

    def down(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             down_out: torch.Tensor) -> None:
        """down_out [M, top_k, H] += the router-weighted down delta of h [M·top_k, I]."""
        moe_lora_delta("down", h, down_out, self.weights, self.align, top_k=topk_ids.shape[1],
                       topk_weights=topk_weights, adapter_enabled=self.adapter_enabled, max_rank=self.max_rank,
                       fused=self.fused, tf32=self.tf32)


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: str = "silu",
    gated: bool = True,
    block_m: int | None = None,
    align: AlignOutput | None = None,
    tf32: bool = False,
    deltas: MoEDeltas | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    weight_block: tuple[int, int] | None = None,
    w_gate_up_scale_inv: torch.Tensor | None = None,
    w_down_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = Σ_k w_k · (W_down[e_k] act(W_gate_up[e_k] x + b_gate_up[e_k]) + b_down[e_k]) (+ the MoE-LoRA
    deltas of ``deltas``; biases only where given).

    Args:
        x: [M, H] activations (fp32/fp16/bf16), last stride 1.
        topk_ids: [M, top_k] int32/int64 expert ids (< 0 = not here).
        topk_weights: [M, top_k] router weights (fp32 or x's dtype), contiguous.
        w_gate_up: [E_base, 2I, H] (gated: rows [:I] gate, [I:] up) or [E_base, I, H] (non-gated).
        w_down: [E_base, H, I].
        activation: "silu", "gelu_tanh" or "swiglu_oai" (GPT-OSS, with ``alpha`` and ``limit``).
        gated: SwiGLU gating.
        block_m: alignment block rows (default :func:`.configs.base_moe_block_m`).
        align: a precomputed base alignment (graph mode: static buffers), else computed here.
        tf32: TF32 dots for fp32.
        deltas: who adds the LoRA deltas (any ``MoEDeltas``), or None for the base MoE alone.
        b_gate_up: [E_base, 2I] expert biases, gate then up (GPT-OSS's, de-interleaved by the
            reader), or None. b_down: [E_base, H].
        weight_block: (bn, bk) of fp8 block-scaled experts (DESIGN.md §1): ``w_gate_up`` / ``w_down``
            are then float8_e4m3fn with ``w_gate_up_scale_inv`` [E_base, 2·⌈I/bn⌉, ⌈H/bk⌉] and
            ``w_down_scale_inv`` [E_base, ⌈H/bn⌉, ⌈I/bk⌉]; the base GEMMs are w8a8
            (:mod:`.fp8_block`: x and h quantized per token per K-group), the deltas read the
            unquantized x and h. Gated layers without biases.

    Returns:
        y [M, H] in x's dtype.

    Raises:
        KernelPreconditionError: shape / dtype / device mismatches (from the launchers too); an fp8
            block-scaled base with a non-gated layer or biases.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    M, H = x.shape
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dim=2, contiguous=True, device=x.device)
    if topk_ids.shape[0] != M:
        raise KernelPreconditionError(f"topk_ids: {topk_ids.shape[0]} rows for {M} tokens")
    top_k = topk_ids.shape[1]
    w_dtype = x.dtype if weight_block is None else FP8_DTYPE
    check_tensor("w_gate_up", w_gate_up, dtypes=(w_dtype,), dim=3, device=x.device)
    E_base, width, _ = w_gate_up.shape
    inter = width // 2 if gated else width
    check_tensor("w_down", w_down, dtypes=(w_dtype,), shape=(E_base, H, inter), device=x.device)
    if weight_block is not None and (not gated or b_gate_up is not None or b_down is not None):
        raise KernelPreconditionError("fused_moe: an fp8 block-scaled base takes a gated layer without biases")
    if align is None:
        align = moe_align_block_size(topk_ids, E_base,
                                     block_m or base_moe_block_m(M, top_k, E_base, fp8=weight_block is not None))
    num_pairs = M * top_k
    gate_up = torch.empty(M, top_k, width, dtype=x.dtype, device=x.device)
    if weight_block is not None:  # w8a8 base; the deltas below read the unquantized x and h
        q, s = quantize_activation_fp8(x, weight_block[1])
        fp8_moe_gemm(q, s, w_gate_up, w_gate_up_scale_inv, gate_up.view(num_pairs, width), align, block=weight_block,
                     top_k=top_k, num_pairs=num_pairs, in_row_div=top_k, half=inter)
    else:
        fused_moe_gemm(x, w_gate_up, gate_up.view(num_pairs, width), align, top_k=top_k, num_pairs=num_pairs,
                       in_row_div=top_k, tf32=tf32, bias=b_gate_up)
    if deltas is not None:
        deltas.gate_up(x, topk_ids, gate_up)
    h = moe_activation(gate_up.view(num_pairs, width), activation=activation, gated=gated, topk_ids=topk_ids,
                       alpha=alpha, limit=limit)
    down = torch.empty(M, top_k, H, dtype=x.dtype, device=x.device)
    if weight_block is not None:
        q, s = quantize_activation_fp8(h, weight_block[1])
        fp8_moe_gemm(q, s, w_down, w_down_scale_inv, down.view(num_pairs, H), align, block=weight_block, top_k=top_k,
                     num_pairs=num_pairs, in_row_div=1, topk_weights=topk_weights)
    else:
        fused_moe_gemm(h, w_down, down.view(num_pairs, H), align, top_k=top_k, num_pairs=num_pairs, in_row_div=1,
                       topk_weights=topk_weights, tf32=tf32, bias=b_down)
    if deltas is not None:
        deltas.down(h, topk_ids, topk_weights, down)
    return moe_sum(down, topk_ids)
