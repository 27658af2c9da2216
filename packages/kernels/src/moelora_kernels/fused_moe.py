"""The grouped GEMM of the fused MoE over aligned blocks (base gate_up / down, and virtual experts).

Algorithm: program (m, n) takes block m of the alignment (BLOCK_M rows of one expert) and the n-th
BLOCK_N columns; it gathers the block's input rows, multiplies them by the expert's weight over K in
BLOCK_K steps (fp32 accumulation), then in the epilogue optionally multiplies by the router weight
of each pair and by a per-expert scale, optionally adds the existing output, and stores once:

    C[p, n] (+)= scale[e // experts_per_scale] · w_p
                 · (Σ_k A[p // in_row_div, k] · W[e // experts_per_weight, n, k] + bias[e, n])

(``bias`` [E_w, N]: GPT-OSS's expert biases, in the base GEMMs only; DESIGN.md §1)

With LoRA fused (``lora=`` a :class:`GemmLoRA`, the ``fused_moe`` path of DESIGN.md §5): the
alignment is the base one (blocks by expert, the same tiles as a LoRA-free launch), and each row
adds its own token's slot's delta of one slice into the fp32 sum before the epilogue:

    C[p, n] = w_p · (Σ_k A[p // in_row_div, k] · W[e, n, k] + σ_s · (t_p · B[s, e, n, :]) + bias[e, n]),
    t_p = round_dtype(Σ_k A[p // in_row_div, k] · LA[s, e, :, k]),   s = token_lora_mapping[p // top_k]

A block's rows may belong to any slots: after the base K loop, the slots present in the block
are taken ``LORA_SLOT_GROUP`` at a time (their A factors side by side in one tile: one shrink K
loop over the block's rows of those slots, each row keeping its own slot's rank columns, then one
expand dot with their B factors). Rows of a token without a live slot (-1, a slot >= L, a
disabled slot, rank 0 or σ = 0 for this module, an expert >= the factors' E) keep the base sum
as it is (``tl.where``): they are bit-identical to a LoRA-free launch of the same alignment. A
gated gate_up GEMM runs one launch per slice (gate, up: their own A and B) over column views of
the weight and the output ("halves" or GPT-OSS "interleaved": strided views, no copy); the down
GEMM one launch, router-weighted after the sum.

for every pair p in the block (p < num_pairs; padding rows are skipped). Blocks at or past
``num_tokens_post_padded`` and blocks of expert -1 exit first, as do blocks of an expert >= E_w,
blocks whose scale is exactly 0 when adding into C (a slot without this module: C stays
bit-identical, -0.0 included)
and rows outside [0, num_pairs) (a corrupt alignment reads and writes nothing outside the tensors);
an alignment recorded for more experts than ``w`` has, or for another pair count, is refused on
the host (``AlignOutput.num_experts`` / ``num_pairs``). The grid is sized from capacities:
``min(P // BLOCK_M, num_pairs // BLOCK_M + min(E, num_pairs))`` blocks bound the used ones, so at
small M only a few programs launch, and the idle ones return at once.

Tensors (P = alignment rows, E_w = experts of the weight):

- ``a`` [rows_in, K] fp32/fp16/bf16, last stride 1: x [M, H] (``in_row_div = top_k``: row of a
  pair is its token) or h / a LoRA intermediate [M·top_k, K] (``in_row_div = 1``).
- ``w`` [E_w, N, K] same dtype, any strides: base ``w_gate_up`` [E_base, 2I, H] / ``w_down``
  [E_base, H, I]; virtual experts: LoRA A viewed as [L·E, R, H] or B as [L·E, I, R], or a factor
  stored once per slot as [L, R, H] with ``experts_per_weight = E`` (every expert of a slot reads
  the one weight: expert stride 0, no copy). E_w counts expert ids: ``w.shape[0] · experts_per_weight``.
- ``c`` [M·top_k, N] same dtype or fp32, any strides (a column slice of gate_up_out is fine).
- ``sorted_token_ids`` [P] int32, ``expert_ids`` [P // BLOCK_M] int32, ``num_tokens_post_padded``
  [1] int32: one slot of an ``AlignOutput``.
- ``topk_weights`` [M·top_k] fp32/dtype (``mul_routed_weight``); ``scale`` [*] fp32 (σ per slot
  for virtual experts).

Rounding: products accumulate in fp32 (IEEE dots for fp32 unless ``tf32``); the epilogue works in
fp32 (router weight, scale, the old output value) and rounds once to the output dtype. Offsets of
rows, experts and columns are 64-bit. Source: the fused MoE kernel of Triton-based engines (vLLM
``fused_moe_kernel``, SGLang ``fused_moe_triton``) and the Triton matmul tutorial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from moelora_core.align import AlignOutput
from moelora_core.errors import KernelPreconditionError
from moelora_kernels._common import (
    FLOAT_DTYPES,
    check_align_pairs,
    check_grid,
    check_positive_int,
    check_rank_bound,
    check_tensor,
    gemm_launch_options,
    next_pow2,
)
from moelora_kernels._fused_moe_kernels import _fused_moe_gemm_kernel
from moelora_kernels.configs import kernel_config


@dataclass(frozen=True)
class GemmLoRA:
    """One slice's LoRA factors for :func:`fused_moe_gemm` (the base GEMM with the delta fused).

    Attributes:
        lora_a: [L, E, R, K] A of the slice (``LoRAWeights.gate_up_A[s]`` / ``down_A``), last stride
            1, the activation dtype; an expert stride of 0 (a factor shared across experts) is read
            as it is.
        lora_b: [L, E, N, R] B of the slice, last stride 1 (expert stride 0 allowed).
        ranks: [L] int32 the slice's module rank per slot (a strided row of ``module_ranks`` is fine).
        scalings: [L] fp32 its σ per slot.
        token_lora_mapping: [M] int32 slot per token (-1 = no adapter; slots >= L get none too),
            contiguous; a pair p's token is ``p // top_k``.
        adapter_enabled: [L] int32 (0 = the slot's blocks get no LoRA), or None.
        max_rank: host bound on every slot's rank (None = R); tiles are sized for it and the kernel
            clamps each slot's rank to it (caller's duty to cover every active slot's rank).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    token_lora_mapping: torch.Tensor
    adapter_enabled: torch.Tensor | None = None
    max_rank: int | None = None


def used_blocks_bound(num_pairs: int, num_experts: int, block_m: int, capacity_blocks: int) -> int:
    """Host bound on the blocks an alignment can use: ``num_pairs // BLOCK_M + min(E, num_pairs)``.

    Each used expert with c pairs takes ceil(c / BLOCK_M) <= (c - 1) // BLOCK_M + 1 blocks; summed
    over at most min(E, num_pairs) used experts this is at most the bound. Grids sized by it skip
    most idle programs at small M without reading the device.
    """
    return max(1, min(capacity_blocks, num_pairs // block_m + min(num_experts, num_pairs)))


def check_pairs_and_align(rows_name: str, rows: int, *, top_k: int, num_pairs: int, in_row_div: int,
                          align: AlignOutput, slot: int, device: torch.device) -> None:
    """The preconditions every grouped GEMM over an alignment shares (this module's and the fp8 one's):
    ``rows`` input rows serve ``num_pairs`` (token, expert) pairs at ``in_row_div`` pairs a row, and
    ``align`` is an :class:`AlignOutput` whose int32 [S, P] ``sorted_token_ids`` has a slot ``slot``.

    Raises:
        KernelPreconditionError: a count that is not a positive int, too few rows, another align type,
            a slot outside the alignment.
    """
    check_positive_int("top_k", top_k)
    check_positive_int("num_pairs", num_pairs, minimum=0)
    check_positive_int("in_row_div", in_row_div)
    if rows * in_row_div < num_pairs:
        raise KernelPreconditionError(f"{rows_name}: {rows} rows cannot serve {num_pairs} pairs at "
                                      f"in_row_div={in_row_div}")
    if not isinstance(align, AlignOutput):
        raise KernelPreconditionError(f"align: expected an AlignOutput, got {type(align).__name__}")
    check_tensor("align.sorted_token_ids", align.sorted_token_ids, dtypes=(torch.int32,), dim=2, contiguous=True,
                 device=device)
    if not 0 <= slot < align.sorted_token_ids.shape[0]:
        raise KernelPreconditionError(f"slot: {slot} outside the alignment's {align.sorted_token_ids.shape[0]} slots")


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
    experts_per_weight: int = 1,
    add_into: bool = False,
    tf32: bool = False,
    config: dict | None = None,
    bias: torch.Tensor | None = None,
    lora: GemmLoRA | None = None,
) -> torch.Tensor:
    """C[p] (+)= scale · w_p · (A[p // in_row_div] @ W[e(p)]ᵀ + bias[e(p)] (+ σ B t_p)) for every aligned
    pair p (module docstring).

    Args:
        a: [rows_in, K], last stride 1; ``rows_in * in_row_div >= num_pairs``.
        w: [E_w, N, K] weights, same dtype as ``a``.
        c: [num_pairs, N] output, same dtype or fp32; written (or added into) only at aligned pairs.
        align: alignment whose slot ``slot`` groups the pairs by expert id in [0, E_w) (blocks of
            other experts are skipped; one recorded for more experts or other pairs is refused).
        top_k: experts per token (for the grid bound).
        num_pairs: M · top_k, the padding sentinel of ``align``.
        in_row_div: ``top_k`` when ``a`` has one row per token, 1 when one row per pair.
        slot: which slot row of ``align`` to read (0 for the base MoE and virtual experts).
        topk_weights: [num_pairs] (or [M, top_k], contiguous) router weights; multiplies rows.
        scale: fp32 vector; row scale is ``scale[e // experts_per_scale]`` (σ per slot).
        experts_per_weight: expert e reads ``w[e // experts_per_weight]`` (virtual experts over a
            factor stored once per slot: E); ``w`` then serves ``w.shape[0] · experts_per_weight`` ids.
        add_into: add to ``c`` instead of overwriting it.
        tf32: allow TF32 dots for fp32 (default IEEE).
        config: tile overrides (BLOCK_N, BLOCK_K, num_warps, num_stages; LORA_SLOT_GROUP with ``lora``).
        bias: [E_w, N] per-expert bias (GPT-OSS's ``gate_up_proj_bias`` / ``down_proj_bias``; a
            strided column view is fine), same dtype as ``a`` or fp32; added in fp32 before the
            router weight and scale.
        lora: one slice's LoRA factors and the token mapping, fused into this GEMM (module
            docstring); ``align`` is the base alignment over E_w experts. Not with ``scale``,
            ``add_into`` or ``experts_per_weight`` > 1.

    Returns:
        ``c``.

    Raises:
        KernelPreconditionError: dtype / shape / stride / device mismatches, bad sizes; an alignment
            recorded for more experts than ``w`` or for another ``num_pairs``; ``lora`` factors or a
            token mapping of another shape, dtype or device, a ``max_rank`` above R, a
            ``LORA_SLOT_GROUP`` that is not a power of two, ``lora`` with ``scale`` / ``add_into`` /
            ``experts_per_weight`` > 1.
    """
    check_tensor("a", a, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    device, dtype = a.device, a.dtype
    check_tensor("w", w, dtypes=(dtype,), dim=3, device=device)
    check_positive_int("experts_per_weight", experts_per_weight)
    E_stored, N, K = w.shape
    E_w = E_stored * experts_per_weight
    if a.shape[1] != K:
        raise KernelPreconditionError(f"a: {a.shape[1]} columns, but w's reduction size K is {K}")
    # c in a's dtype or fp32: the epilogue works in fp32 and rounds once to c's dtype.
    check_tensor("c", c, dtypes=(dtype, torch.float32), shape=(num_pairs, N), device=device)
    check_pairs_and_align("a", a.shape[0], top_k=top_k, num_pairs=num_pairs, in_row_div=in_row_div, align=align,
                          slot=slot, device=device)
    P = align.sorted_token_ids.shape[1]
    num_blocks = align.expert_ids.shape[1]
    if num_blocks == 0 or P % num_blocks:
        raise KernelPreconditionError(f"align: {P} rows do not split into {num_blocks} blocks")
    block_m = P // num_blocks
    check_align_pairs(align, num_pairs)
    lora_args = _lora_args(lora, a, w, N, K, top_k, num_pairs, scale, add_into, experts_per_weight)
    if align.num_experts is not None and align.num_experts > E_w:
        raise KernelPreconditionError(f"align: made for {align.num_experts} experts, but w holds {E_w}: blocks of "
                                      f"experts >= {E_w} have no weight (align with w's expert count)")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32, dtype), contiguous=True, device=device)
        if topk_weights.numel() != num_pairs:
            raise KernelPreconditionError(f"topk_weights: {topk_weights.numel()} elements for {num_pairs} pairs")
    if scale is not None:
        check_tensor("scale", scale, dtypes=(torch.float32,), dim=1, contiguous=True, device=device)
        check_positive_int("experts_per_scale", experts_per_scale)
        if scale.shape[0] * experts_per_scale < E_w:
            raise KernelPreconditionError(
                f"scale: {scale.shape[0]} entries × experts_per_scale={experts_per_scale} < {E_w} experts")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(dtype, torch.float32), shape=(E_w, N), device=device)
    if num_pairs == 0:
        return c
    cfg = kernel_config("fused_moe_gemm", rows=num_pairs, N=N, K=K, overrides=config)
    grid_m = used_blocks_bound(num_pairs, E_w, block_m, num_blocks)
    grid = check_grid("fused_moe_gemm", (grid_m, triton.cdiv(N, cfg["BLOCK_N"])))
    dummy = align.num_tokens_post_padded
    _fused_moe_gemm_kernel[grid](
        a, w, c,
        align.sorted_token_ids[slot], align.expert_ids[slot], align.num_tokens_post_padded[slot:slot + 1],
        topk_weights if topk_weights is not None else dummy,
        scale if scale is not None else dummy,
        bias if bias is not None else dummy,
        *lora_args["pointers"],
        N, K, num_pairs, in_row_div, experts_per_scale, experts_per_weight, E_w, *lora_args["sizes"],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        *lora_args["strides"],
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        ADD_INTO=add_into, HAS_LORA=lora is not None,
        HAS_ENABLED=lora is not None and lora.adapter_enabled is not None, BLOCK_R=lora_args["block_r"],
        SLOT_GROUP=_slot_group(cfg, lora_args),
        **gemm_launch_options(dtype, tf32, cfg),
    )
    return c


def _lora_args(lora: GemmLoRA | None, a: torch.Tensor, w: torch.Tensor, N: int, K: int, top_k: int,
               num_pairs: int, scale, add_into: bool, experts_per_weight: int) -> dict:
    """The kernel arguments of ``lora`` after its checks: pointers (A, B, ranks, σ, enabled,
    mapping), sizes (L, E of the factors, top_k, rank bound), strides, BLOCK_R and L (dummies
    without LoRA)."""
    if lora is None:
        dummy = w
        return {"pointers": (dummy,) * 6, "sizes": (0, 0, 1, 0), "strides": (0,) * 8, "block_r": 16, "slots": 0}
    if not isinstance(lora, GemmLoRA):
        raise KernelPreconditionError(f"lora: expected a GemmLoRA, got {type(lora).__name__}")
    if scale is not None or add_into or experts_per_weight != 1:
        raise KernelPreconditionError("lora: the fused LoRA base GEMM takes no scale, add_into or experts_per_weight")
    device, dtype = a.device, a.dtype
    check_tensor("lora.lora_a", lora.lora_a, dtypes=(dtype,), dim=4, unit_last_stride=True, device=device)
    L, E, R, K_a = lora.lora_a.shape
    if K_a != K:
        raise KernelPreconditionError(f"lora.lora_a: input width {K_a} != the GEMM's K={K}")
    check_tensor("lora.lora_b", lora.lora_b, dtypes=(dtype,), shape=(L, E, N, R), unit_last_stride=True,
                 device=device)
    check_tensor("lora.ranks", lora.ranks, dtypes=(torch.int32,), shape=(L,), device=device)
    check_tensor("lora.scalings", lora.scalings, dtypes=(torch.float32,), shape=(L,), device=device)
    if lora.adapter_enabled is not None:
        check_tensor("lora.adapter_enabled", lora.adapter_enabled, dtypes=(torch.int32,), shape=(L,),
                     contiguous=True, device=device)
    if num_pairs % top_k:
        raise KernelPreconditionError(f"lora: {num_pairs} pairs are not whole tokens of top_k={top_k}")
    check_tensor("lora.token_lora_mapping", lora.token_lora_mapping, dtypes=(torch.int32,),
                 shape=(num_pairs // top_k,), contiguous=True, device=device)
    rank_bound = check_rank_bound(lora.max_rank, R)
    A, B = lora.lora_a, lora.lora_b
    enabled = lora.adapter_enabled if lora.adapter_enabled is not None else lora.ranks
    return {
        "pointers": (A, B, lora.ranks, lora.scalings, enabled, lora.token_lora_mapping),
        "sizes": (L, E, top_k, rank_bound),
        "strides": (A.stride(0), A.stride(1), A.stride(2), B.stride(0), B.stride(1), B.stride(2),
                    lora.ranks.stride(0), lora.scalings.stride(0)),
        "block_r": next_pow2(rank_bound, 16),
        "slots": L,
    }


def _slot_group(cfg: dict, lora_args: dict) -> int:
    """Slots per shrink/expand tile pair: the config's ``LORA_SLOT_GROUP``, or (0) as many as fit
    64 rank columns (one slot at R > 32), never more than the pool's slots rounded up to a power
    of two."""
    group = int(cfg.get("LORA_SLOT_GROUP", 0))
    if group < 0 or group & (group - 1):
        raise KernelPreconditionError(f"config: LORA_SLOT_GROUP={group} is not a power of two (or 0: by rank)")
    if group == 0:
        group = max(1, 64 // lora_args["block_r"])
    return max(1, min(group, next_pow2(lora_args["slots"])))
