"""The element-wise steps of the base fused MoE: the expert activation and the top-k sum.

Algorithms (grids ``(rows, cdiv(width, BLOCK))``, one row and one column tile per program):

- activation, gated (SwiGLU): ``h[p, i] = act(gate_up[p, i]) · gate_up[p, I + i]``;
  non-gated: ``h[p, i] = act(gate_up[p, i])`` (``gate_up`` is then [rows, I]).
  ``act`` is SiLU (``x · sigmoid(x)``) or tanh-approximated GELU; ``"swiglu_oai"`` (GPT-OSS,
  gated only) is ``min(g, L) · sigmoid(α · min(g, L)) · (clamp(u, -L, L) + 1)`` with α = ``alpha``,
  L = ``limit`` (DESIGN.md §1). Gate and up sit in a row as "halves" (gate i, up I + i): the
  readers de-interleave GPT-OSS's checkpoint columns at load. With ``topk_ids``, programs of pairs
  with a negative id exit first: their gate_up rows were never written (uninitialised memory), and
  their h rows are never read.
- top-k sum: ``y[t, :] = Σ_j [topk_ids[t, j] >= 0] · down_out[t, j, :]``; pairs of EXPERT_NOT_HERE
  (negative ids) contribute nothing, whatever their (never written) ``down_out`` rows hold.

Tensors: ``gate_up`` [rows, 2I] (gated) or [rows, I]; ``h`` [rows, I]; ``down_out`` [M, top_k, H];
``topk_ids`` [M, top_k] int32/int64; ``y`` [M, H]; all floats one dtype (fp32/fp16/bf16), rows with
last stride 1.

Rounding: inputs are widened to fp32, the activation / sum is computed in fp32 and rounded once to
the output dtype. Source: SwiGLU (Shazeer 2020, arXiv:2002.05202) as in Mixtral / Qwen3-MoE
experts; the top-k reduction of vLLM's ``moe_sum``.

Launch: the config table's ``moe_epilogue`` entry of the row count (or ``config``) gives ``PDL``
(programmatic dependent launch, :func:`moelora_kernels._common.pdl_options`); no tiles to tune.
"""

from __future__ import annotations

import torch
import triton

from moelora_core.errors import KernelPreconditionError
from moelora_kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check_grid, check_tensor, next_pow2, pdl_options
from moelora_kernels._moe_epilogue_kernels import _moe_activation_kernel, _moe_sum_kernel
from moelora_kernels.configs import kernel_config

ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "swiglu_oai")


def moe_activation(
    gate_up: torch.Tensor,
    *,
    activation: str = "silu",
    gated: bool = True,
    topk_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    config: dict | None = None,
) -> torch.Tensor:
    """h = act(gate) ⊙ up (gated) or act(gate_up) (non-gated), row by row.

    Args:
        gate_up: [rows, 2I] (gated) or [rows, I], last stride 1.
        activation: "silu", "gelu_tanh" or "swiglu_oai" (GPT-OSS's clamped SwiGLU, gated only).
        gated: SwiGLU-style gating by the up columns.
        topk_ids: [M, top_k] int32/int64 with M·top_k = rows, or None: rows of pairs with a
            negative id are skipped (left unwritten).
        out: [rows, I] (allocated when None), same dtype, last stride 1.
        alpha, limit: swiglu_oai's α and clamp bound (GPT-OSS: 1.702, 7.0); ignored otherwise.
        config: overrides of the table's ``moe_epilogue`` entry (``PDL``).

    Returns:
        h [rows, I].

    Raises:
        KernelPreconditionError: unknown activation; swiglu_oai without gating; limit <= 0; odd width
            when gated; dtype/shape/stride errors; ``PDL`` not 0 / 1, or 1 below sm_90.
    """
    if activation not in ACTIVATIONS:
        raise KernelPreconditionError(f"activation: {activation!r} not in {ACTIVATIONS}")
    if not gated and activation == "swiglu_oai":
        raise KernelPreconditionError(f"activation {activation!r} needs gated=True")
    if not limit > 0:
        raise KernelPreconditionError(f"limit: must be > 0, got {limit}")
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    rows, width = gate_up.shape
    if gated and width % 2:
        raise KernelPreconditionError(f"gate_up: gated activation needs an even width [rows, 2I], got {width}")
    inter = width // 2 if gated else width
    if out is None:
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    check_tensor("out", out, dtypes=(gate_up.dtype,), shape=(rows, inter), unit_last_stride=True,
                 device=gate_up.device)
    if topk_ids is not None:
        check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dim=2, contiguous=True, device=gate_up.device)
        if topk_ids.numel() != rows:
            raise KernelPreconditionError(f"topk_ids: {topk_ids.numel()} pairs for {rows} rows")
    pdl = pdl_options(kernel_config("moe_epilogue", rows=rows, overrides=config), gate_up.device)
    if rows == 0:
        return out
    block = min(1024, next_pow2(inter, 32))
    grid = check_grid("moe_activation", (rows, triton.cdiv(inter, block)))
    _moe_activation_kernel[grid](
        gate_up, out, topk_ids if topk_ids is not None else out, inter, float(alpha), float(limit),
        gate_up.stride(0), out.stride(0),
        BLOCK=block, ACTIVATION=activation, GATED=gated, HAS_IDS=topk_ids is not None, **pdl,
    )
    return out


def moe_sum(down_out: torch.Tensor, topk_ids: torch.Tensor, *, out: torch.Tensor | None = None,
            config: dict | None = None) -> torch.Tensor:
    """y[t] = Σ_j down_out[t, j] over the pairs whose expert id is >= 0.

    Args:
        down_out: [M, top_k, H] router-weighted down output per pair, last stride 1.
        topk_ids: [M, top_k] int32/int64, contiguous.
        out: [M, H] (allocated when None), last stride 1.
        config: overrides of the table's ``moe_epilogue`` entry (``PDL``).

    Returns:
        y [M, H].

    Raises:
        KernelPreconditionError: dtype/shape/stride/device errors; ``PDL`` not 0 / 1, or 1 below sm_90.
    """
    check_tensor("down_out", down_out, dtypes=FLOAT_DTYPES, dim=3, unit_last_stride=True)
    M, top_k, hidden = down_out.shape
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, shape=(M, top_k), contiguous=True,
                 device=down_out.device)
    if out is None:
        out = torch.empty(M, hidden, dtype=down_out.dtype, device=down_out.device)
    check_tensor("out", out, dtypes=(down_out.dtype,), shape=(M, hidden), unit_last_stride=True,
                 device=down_out.device)
    pdl = pdl_options(kernel_config("moe_epilogue", rows=M * top_k, overrides=config), down_out.device)
    if M == 0:
        return out
    block = min(1024, next_pow2(hidden, 32))
    grid = check_grid("moe_sum", (M, triton.cdiv(hidden, block)))
    _moe_sum_kernel[grid](
        down_out, topk_ids, out, hidden, top_k, down_out.stride(0), down_out.stride(1), out.stride(0),
        BLOCK=block, **pdl,
    )
    return out
