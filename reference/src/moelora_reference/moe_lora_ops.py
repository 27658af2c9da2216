"""Readable twins of the MoE-LoRA shrink / expand kernels (``moelora_kernels.moe_lora``).

Same signatures and meaning as the kernels; loops over slots and alignment blocks, float64 math,
rounded at the kernels' rounding points. The stage is explicit:

- "gate_up": two slices (s = 0 gate, 1 up), each with its own A [L, E, R, H] and B [L, E, I, R];
  input row of pair p is token p // top_k; slice s writes columns [s·I, (s+1)·I) of gate_up_out.
- "down": one slice, input row p of h [M·top_k, I]; router-weighted.

For a block of slot l and expert e >= 0 (slot enabled, module rank r = min(ranks[s, l], max_rank) > 0):

    shrink:  t[s, p, :r] = round(A[s, l, e, :r] @ in[p]);  t[s, p, r:] = 0
    expand:  out[p, s] = round(out[p, s] + σ[s, l] · w_p · B[s, l, e, :, :r] @ t[s, p, :r])

(w_p = 1 for gate_up). Rows of other pairs are not touched. Any device: the loops run on host copies
of the alignment, the math where the data lives. Source: the MoE-LoRA equation of
DESIGN.md §1 (:mod:`moelora_reference.oracle`), laid out as vLLM's fused MoE-LoRA
(vllm-project/vllm#21229) and SGLang's MoE-LoRA (sgl-project/sglang#14105).
"""

from __future__ import annotations

import torch

from moelora_core.align import AlignOutput

F64 = torch.float64


def _slices(stage: str, lora: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor | None):
    """[S, L, E, ...] weights, [S, L] ranks / σ for the stage."""
    if stage == "gate_up":
        return lora, ranks, scalings
    if stage == "down":
        return lora.unsqueeze(0), ranks.unsqueeze(0), None if scalings is None else scalings.unsqueeze(0)
    raise ValueError(f"stage {stage!r} not in ('gate_up', 'down')")


def _blocks(align: AlignOutput, slot: int, num_pairs: int, device: torch.device):
    """(expert, pair indices on ``device``) of every used block of ``slot`` with an expert >= 0."""
    sorted_ids = align.sorted_token_ids[slot].tolist()  # [P]
    expert_ids = align.expert_ids[slot].tolist()  # [P // BLOCK_M]
    block_m = len(sorted_ids) // len(expert_ids)
    for b in range(int(align.num_tokens_post_padded[slot]) // block_m):
        e = expert_ids[b]
        rows = [p for p in sorted_ids[b * block_m:(b + 1) * block_m] if p < num_pairs]
        if e >= 0 and rows:
            yield e, torch.tensor(rows, device=device)


def _active(adapter_enabled, slot, rank):
    return rank > 0 and (adapter_enabled is None or int(adapter_enabled[slot]) != 0)


def fused_moe_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    align: AlignOutput,
    *,
    stage: str,
    top_k: int,
    ranks: torch.Tensor,
    adapter_enabled: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> torch.Tensor:
    """t[s, p] = A[s, slot, e] @ in[p] (rank-wide, rounded to x's dtype) for every aligned pair.

    Args:
        x: gate_up [M, H]; down [M·top_k, I].
        lora_a: gate_up [2, L, E, R, H]; down [L, E, R, I].
        align: alignment of the pairs per slot.
        ranks: gate_up [2, L]; down [L] (module rank per slot).
        out: [S, M·top_k, R] or None (then NaN-filled: rows of unaligned pairs stay NaN).
        max_rank: host rank bound (None = R).

    Returns:
        The intermediate [S, M·top_k, R].
    """
    A, rk, _ = _slices(stage, lora_a, ranks, None)
    S, L, _, R, _ = A.shape
    num_pairs = x.shape[0] * top_k if stage == "gate_up" else x.shape[0]
    in_row_div = top_k if stage == "gate_up" else 1
    bound = R if max_rank is None else max_rank
    if out is None:
        out = torch.full((S, num_pairs, R), float("nan"), dtype=x.dtype, device=x.device)
    for slot in range(L):
        for s in range(S):
            r = min(int(rk[s, slot]), bound)
            if not _active(adapter_enabled, slot, r):
                continue
            for e, p in _blocks(align, slot, num_pairs, x.device):
                t = torch.zeros(len(p), R, dtype=F64, device=x.device)
                t[:, :r] = x[p // in_row_div].to(F64) @ A[s, slot, e, :r].to(F64).T  # [rows, r]
                out[s, p] = t.to(out.dtype)
    return out


def fused_moe_lora_expand(
    intermediate: torch.Tensor,
    lora_b: torch.Tensor,
    align: AlignOutput,
    out: torch.Tensor,
    *,
    stage: str,
    top_k: int,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    adapter_enabled: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> torch.Tensor:
    """out[p, slice s] += σ[s, slot] · w_p · B[s, slot, e] @ t[s, p], rounded once, in place; slice s
    of gate_up is columns [s·I, (s+1)·I).

    Args:
        intermediate: [S, M·top_k, R].
        lora_b: gate_up [2, L, E, I, R]; down [L, E, H, R].
        out: gate_up [M, top_k, 2I] or [M·top_k, 2I]; down [M, top_k, H] or [M·top_k, H].
        scalings: gate_up [2, L]; down [L] (fp32 σ per module and slot).
        topk_weights: down only, [M, top_k].

    Returns:
        ``out``.
    """
    B, rk, sc = _slices(stage, lora_b, ranks, scalings)
    S, L, _, N, R = B.shape
    num_pairs = intermediate.shape[1]
    o = out.view(num_pairs, S * N)
    w = None if topk_weights is None else topk_weights.reshape(-1).to(F64)
    bound = R if max_rank is None else max_rank
    for slot in range(L):
        for s in range(S):
            r = min(int(rk[s, slot]), bound)
            if not _active(adapter_enabled, slot, r):
                continue
            for e, p in _blocks(align, slot, num_pairs, out.device):
                delta = intermediate[s, p, :r].to(F64) @ B[s, slot, e, :, :r].to(F64).T  # [rows, N]
                delta = delta * float(sc[s, slot])
                if w is not None:
                    delta = delta * w[p][:, None]
                cols = slice(s * N, (s + 1) * N)
                o[p, cols] = (o[p, cols].to(F64) + delta).to(out.dtype)
    return out


def fused_moe_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    align: AlignOutput,
    out: torch.Tensor,
    *,
    stage: str,
    top_k: int,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    adapter_enabled: torch.Tensor | None = None,
    max_rank: int | None = None,
) -> torch.Tensor:
    """Shrink then expand (the fused kernel rounds t to x's dtype between them, like this)."""
    inter = fused_moe_lora_shrink(x, lora_a, align, stage=stage, top_k=top_k, ranks=ranks,
                                  adapter_enabled=adapter_enabled, max_rank=max_rank)
    return fused_moe_lora_expand(inter, lora_b, align, out, stage=stage, top_k=top_k, ranks=ranks,
                                 scalings=scalings, topk_weights=topk_weights, adapter_enabled=adapter_enabled,
                                 max_rank=max_rank)
