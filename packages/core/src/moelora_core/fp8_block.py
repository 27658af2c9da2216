"""fp8 block-scaled base weights (DESIGN.md §1, "Quantized base"): the names, the scale grid, the checks.

The format is the one HF writes for Qwen3-FP8 and DeepSeek-V3 checkpoints
(``quantization_config: {"quant_method": "fp8", "weight_block_size": [bn, bk],
"activation_scheme": "dynamic"}``): a weight W [N, K] is stored as ``weight`` float8_e4m3fn [N, K]
and ``weight_scale_inv`` fp32 [⌈N/bn⌉, ⌈K/bk⌉], and W ≈ weight · scale_inv of its block. Edge blocks
may be partial (the grid covers ⌈N/bn⌉ × ⌈K/bk⌉ blocks).

Activations are quantized on the fly per token and per K-group of bk (w8a8, ``activation_scheme:
dynamic``), as vLLM's ``per_token_group_quant_fp8``: s = fp32(max(amax, ACT_SCALE_EPS) / 448),
q = RNE_e4m3(clamp(fp32(x / s), -448, 448)). The clamp and the round-to-nearest-even are explicit
in every implementation (the Triton interpreter's fp32 → fp8 cast rounds ties away from zero and
does not saturate). The oracle (``moelora_reference.oracle``) emulates this independently in fp64;
this module holds only what every side shares: names, sizes, the weight quantizer the fixture
builder and the tests use, and the shape checks.
"""

from __future__ import annotations

import math

import torch

from moelora_core.errors import InvalidFieldError

#: ``LoRALayerSpec.base_quant`` values: the base weights as stored; "fp8_block" = fp8 e4m3 weights
#: with block scales, activations quantized per token per K-group (w8a8).
BASE_QUANTS: tuple[str, ...] = ("none", "fp8_block")
#: Largest finite float8_e4m3fn value: quantized values are clamped to ±FP8_E4M3_MAX.
FP8_E4M3_MAX = 448.0
#: Floor of a group's amax before its scale is taken (vLLM ``per_token_group_quant_fp8``'s eps), so
#: an all-zero group gets a finite scale and quantizes to zeros.
ACT_SCALE_EPS = 1e-10
#: The fp8 storage dtype of the weights.
FP8_DTYPE = torch.float8_e4m3fn


def check_base_quant(value: object) -> str:
    """``value`` if it is one of :data:`BASE_QUANTS`.

    Raises:
        InvalidFieldError: anything else.
    """
    if value not in BASE_QUANTS:
        raise InvalidFieldError("base_quant", f"must be one of {BASE_QUANTS}, got {value!r}")
    return value  # type: ignore[return-value]


def scale_grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """(⌈n/bn⌉, ⌈k/bk⌉): the shape of ``weight_scale_inv`` of an [n, k] weight (partial edge blocks count)."""
    bn, bk = block
    return (math.ceil(n / bn), math.ceil(k / bk))


def check_block(block: object, field: str = "weight_block_size") -> tuple[int, int]:
    """``block`` as (bn, bk) of two positive ints.

    Raises:
        InvalidFieldError: not a pair of positive ints.
    """
    if not isinstance(block, (tuple, list)) or len(block) != 2 or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block):
        raise InvalidFieldError(field, f"expected [block_n, block_k] of two positive ints, got {block!r}")
    return (int(block[0]), int(block[1]))


def check_scale(weight: torch.Tensor, scale_inv: torch.Tensor | None, block: tuple[int, int], field: str) -> None:
    """Refuse an fp8 weight [.., N, K] whose ``scale_inv`` is missing or not [.., ⌈N/bn⌉, ⌈K/bk⌉].

    Raises:
        InvalidFieldError: naming ``field``, the expected and found shapes.
    """
    if weight.dtype != FP8_DTYPE:
        raise InvalidFieldError(field, f"expected {FP8_DTYPE} weights, got {weight.dtype}")
    if scale_inv is None:
        raise InvalidFieldError(f"{field}_scale_inv", "missing: an fp8 block-scaled weight needs its scales")
    *lead, n, k = weight.shape
    expected = (*lead, *scale_grid(n, k, block))
    if tuple(scale_inv.shape) != expected:
        raise InvalidFieldError(f"{field}_scale_inv", f"expected {expected} for a {tuple(weight.shape)} weight at "
                                                      f"block {list(block)}, got {tuple(scale_inv.shape)}")


def quantize_weight_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W [.., N, K] to (weight float8_e4m3fn [.., N, K], scale_inv fp32 [.., ⌈N/bn⌉, ⌈K/bk⌉]).

    Per block: scale_inv = amax / 448 (1 for an all-zero block), weight = RNE_e4m3(W / scale_inv)
    (torch's cast, in range by construction): DeepSeek-V3's ``weight_quant`` and what HF checkpoints
    hold. Used by moelora's fixture builder and tests, never by the oracle's computation.
    """
    bn, bk = check_block(block, "block")
    *lead, n, k = w.shape
    gn, gk = scale_grid(n, k, (bn, bk))
    wf = w.detach().to(torch.float32)
    pad = torch.zeros(*lead, gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = wf
    blocks = pad.reshape(*lead, gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [.., gn, gk]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    q = (wf / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def gate_up_scale_rows(moe_intermediate_size: int, block_n: int) -> int:
    """Rows of a fused gate_up scale: gate's ⌈I/bn⌉ blocks then up's (each half keeps its own grid, as
    the checkpoint stores gate_proj and up_proj apart; a partial last block of gate never spans into up)."""
    return 2 * math.ceil(moe_intermediate_size / block_n)


def weight_row_blocks(n: int, block_n: int, half: int | None, device: torch.device) -> torch.Tensor:
    """[n] long: the scale row of each weight row. ``half`` = I for a fused gate_up ([2I] rows, gate's
    grid then up's, ``moelora_core.fp8_block.gate_up_scale_rows``), None for one grid."""
    rows = torch.arange(n, device=device)
    if half is None:
        return rows // block_n
    return (rows // half) * math.ceil(half / block_n) + (rows % half) // block_n


def dequantize_weight(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      half: int | None = None) -> torch.Tensor:
    """Ŵ = W_q · scale_inv of its block, fp32, for W_q [.., N, K] fp8 and scale_inv [.., rows, ⌈K/bk⌉]:
    the format's dequantized weight (the torch base path, hf-check and the adapter-effect probe read it;
    no activation quantization here)."""
    bn, bk = block
    n, k = w_q.shape[-2:]
    s = scale_inv.to(torch.float32).index_select(-2, weight_row_blocks(n, bn, half, w_q.device))
    return w_q.to(torch.float32) * s.repeat_interleave(bk, dim=-1)[..., :k]
