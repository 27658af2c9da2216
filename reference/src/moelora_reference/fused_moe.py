"""Readable twins of the base fused-MoE kernels (``moelora_kernels.fused_moe`` / ``.moe_epilogue``).

Same signatures and meaning as the kernels, written as loops over alignment blocks in float64,
rounded to the output dtype at the kernels' rounding points (any device: the loops run on host
copies of the alignment, the math where the data lives):

- :func:`fused_moe_gemm`: for every block b of the slot with expert e >= 0 and every pair p in it
  (p < num_pairs): ``c[p] (+)= scale[e // experts_per_scale] · w_p · (W[e] @ a[p // in_row_div] + bias[e])``,
  rounded once (the old value of c joins the sum before rounding when ``add_into``).
- :func:`moe_activation`: ``h = silu(g) ⊙ u`` (gated), ``act(g)``, or GPT-OSS's clamped
  ``swiglu_oai`` (:func:`moelora_reference.oracle.gated_activation`), gate/up as halves, rounded
  once.
- :func:`moe_sum`: ``y[t] = Σ_j [topk_ids[t, j] >= 0] · down_out[t, j]``, rounded once.
- :func:`fused_moe`: the base MoE layer through those steps (the rounding points of the Triton
  path: gate_up output, h, the router-weighted down output per pair, y).

Source: the fused MoE of vLLM / SGLang (grouped GEMM over ``moe_align_block_size`` blocks);
SwiGLU experts of Mixtral / Qwen3-MoE. The one equation is in :mod:`moelora_reference.oracle`.
"""

from __future__ import annotations

import math

import torch

from moelora_core.align import AlignOutput
from moelora_core.moe_activation import MoEActivation
from moelora_reference.base_moe import split_gate_up
from moelora_reference.oracle import gated_activation

F64 = torch.float64


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    align: AlignOutput,
    *,
    top_k: int,
    num_pairs: int,
    in_row_div: int,
    slot: int = 0,
    topk_weights: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    experts_per_scale: int = 1,
    add_into: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """c[p] (+)= scale · w_p · (W[e(p)] @ a[p // in_row_div] + bias[e(p)]) over the aligned pairs of
    ``slot``.

    Args:
        a: [rows_in, K]; w: [E_w, N, K]; c: [num_pairs, N] (written in place at aligned pairs only).
        align: ``AlignOutput`` (rows per block = P // number of blocks).
        top_k: experts per token.
        num_pairs: M · top_k; rows >= it are padding.
        in_row_div: top_k when ``a`` is per token, 1 when per pair.
        topk_weights: [num_pairs] (any shape with that many elements) router weights, or None.
        scale: per-scale-group factor (σ per slot for virtual experts), or None.
        add_into: add to c rather than overwrite.
        bias: [E_w, N] per-expert bias (GPT-OSS), or None.

    Returns:
        ``c``.
    """
    sorted_ids = align.sorted_token_ids[slot].tolist()  # [P]
    expert_ids = align.expert_ids[slot].tolist()  # [P // BLOCK_M]
    block_m = len(sorted_ids) // len(expert_ids)
    used = int(align.num_tokens_post_padded[slot])
    weights = None if topk_weights is None else topk_weights.reshape(-1).to(F64)
    for b in range(used // block_m):
        e = expert_ids[b]
        if e < 0:
            continue  # NO_EXPERT_BLOCK
        rows = [p for p in sorted_ids[b * block_m:(b + 1) * block_m] if p < num_pairs]
        if not rows:
            continue
        p = torch.tensor(rows, device=c.device)
        v = a[p // in_row_div].to(F64) @ w[e].to(F64).T  # [rows, N]
        if bias is not None:
            v = v + bias[e].to(F64)
        if weights is not None:
            v = v * weights[p][:, None]
        if scale is not None:
            v = v * float(scale[e // experts_per_scale])
        if add_into:
            v = v + c[p].to(F64)
        c[p] = v.to(c.dtype)
    return c


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return x * torch.sigmoid(x)
    if activation == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"unknown activation {activation!r}")


def moe_activation(
    gate_up: torch.Tensor, *, activation: str = "silu", gated: bool = True, out: torch.Tensor | None = None,
    alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """h = act(gate) ⊙ up (gated; gate [:I], up [I:]), act(gate_up) (non-gated), or GPT-OSS's
    ``swiglu_oai`` ``min(g, L) · sigmoid(α min(g, L)) ⊙ (clamp(u, ±L) + 1)``; rounded once.

    Args:
        gate_up: [rows, 2I] or [rows, I]. out: [rows, I] or None.
        alpha, limit: swiglu_oai's α and clamp bound.
    """
    g = gate_up.to(F64)
    if not gated:
        h = _act(g, activation)
    else:
        gate, up = split_gate_up(g)  # [rows, I] each
        if activation == "swiglu_oai":
            h = gated_activation(gate, up, MoEActivation("swiglu_oai", alpha=alpha, limit=limit))
        else:
            h = _act(gate, activation) * up
    h = h.to(gate_up.dtype)
    if out is None:
        return h
    out.copy_(h)
    return out


def moe_sum(down_out: torch.Tensor, topk_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = Σ_j down_out[t, j] over pairs with topk_ids[t, j] >= 0; rounded once.

    Args:
        down_out: [M, top_k, H]; topk_ids: [M, top_k]; out: [M, H] or None.
    """
    here = (topk_ids >= 0)[:, :, None]  # [M, top_k, 1]
    # where, not a product: rows of EXPERT_NOT_HERE pairs are never written and may hold NaN
    y = torch.where(here, down_out.to(F64), 0.0).sum(dim=1)  # [M, H]
    y = y.to(down_out.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    align: AlignOutput,
    *,
    activation: str = "silu",
    gated: bool = True,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The base MoE layer at the Triton path's rounding points (biases and GPT-OSS's activation as
    ``moelora_kernels.fused_moe``).

    Args:
        x: [M, H]; topk_ids: [M, top_k] (< 0 = not here; any id < E_base is a base expert);
        topk_weights: [M, top_k]; w_gate_up: [E_base, 2I, H] (or [E_base, I, H] non-gated);
        w_down: [E_base, H, I]; align: the base alignment (one slot) of ``topk_ids`` over E_base.

    Returns:
        y [M, H] in x's dtype.
    """
    M, top_k = topk_ids.shape
    num_pairs = M * top_k
    gate_up = torch.full((num_pairs, w_gate_up.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    fused_moe_gemm(x, w_gate_up, gate_up, align, top_k=top_k, num_pairs=num_pairs, in_row_div=top_k, bias=b_gate_up)
    h = moe_activation(gate_up, activation=activation, gated=gated, alpha=alpha,
                       limit=limit)  # [num_pairs, I]
    down = torch.full((num_pairs, w_down.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    fused_moe_gemm(h, w_down, down, align, top_k=top_k, num_pairs=num_pairs, in_row_div=1,
                   topk_weights=topk_weights, bias=b_down)
    return moe_sum(down.view(M, top_k, -1), topk_ids)
