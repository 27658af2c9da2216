"""The grouped GEMM of the fused MoE over aligned blocks (base gate_up / down, and virtual experts).

Algorithm: program (m, n) takes block m of the alignment (BLOCK_M rows of one expert) and the n-th
BLOCK_N columns; it gathers the block's input rows, multiplies them by the expert's weight over K in
BLOCK_K steps (fp32 accumulation), then in the epilogue optionally multiplies by the router weight
of each pair and by a per-expert scale, optionally adds the existing output, and stores once:

    C[p, n] (+)= scale[e // experts_per_scale] · w_p
                 · (Σ_k A[p // in_row_div, k] · W[e // experts_per_weight, n, k] + bias[e, n])

for every pair p in the block (p < num_pairs; padding rows are skipped; ``bias`` [E_w, N]: GPT-OSS's
expert biases, in the base GEMMs only, DESIGN.md §1). Blocks at or past
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

The config key ``W_DESC`` (0 or 1) of ``fused_moe_gemm``: 1 reads the weight tiles through a Hopper TMA
tensor descriptor over the weight's rows [E_w' · N, K] (block [BLOCK_N, BLOCK_K], zero padding) instead of
masked pointer loads, where the weight's layout allows one (:func:`weight_descriptor`; elsewhere the
pointer loads run); the A tiles stay gathered by pointer (Hopper's TMA has no row gather). The same
products, summed within a dot in whatever order the dot takes for a transposed tile (the interpreter's
matmul differs there in the last fp32 bits): results agree with the pointer loads' within the GEMM's
tolerance, not bit for bit (``test_kernel_weight_desc.py``). The 2-D view reads whole BLOCK_N-row boxes
even where N is far smaller than BLOCK_N (a LoRA factor's rank), so the shipped tables set it only on
base-shape entries. The descriptor is made on each launch (host time in eager mode; a CUDA graph replays
it). Source: a variant of SGLang's ``fused_moe_kernel`` ``b_use_tma`` (its configs' ``USE_TMA``), which
takes a 3-D descriptor over [E, N, K] per expert, and the Triton tutorials' host-side ``TensorDescriptor``.

Rounding: products accumulate in fp32 (IEEE dots for fp32 unless ``tf32``); the epilogue works in
fp32 (router weight, scale, the old output value) and rounds once to the output dtype. Offsets of
rows, experts and columns are 64-bit (the descriptor's row coordinate is int32, bounded on the host).
Source: the fused MoE kernel of Triton-based engines (vLLM ``fused_moe_kernel``, SGLang
``fused_moe_triton``) and the Triton matmul tutorial.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from moelora_core.align import AlignOutput
from moelora_core.errors import KernelPreconditionError
from moelora_kernels._common import (
    FLOAT_DTYPES,
    check_align_pairs,
    check_config_choice,
    check_grid,
    check_positive_int,
    check_tensor,
    gemm_launch_options,
    pdl_options,
)
from moelora_kernels._fused_moe_kernels import _fused_moe_gemm_kernel
from moelora_kernels.configs import kernel_config


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
) -> torch.Tensor:
    """C[p] (+)= scale · w_p · (A[p // in_row_div] @ W[e(p)]ᵀ + bias[e(p)]) for every aligned pair p
    (module docstring).

    Args:
        a: [rows_in, K], last stride 1; ``rows_in * in_row_div >= num_pairs``.
        w: [E_w, N, K] weights, same dtype as ``a``.
        c: [num_pairs, N] output, same dtype or fp32; written (or added into) only at aligned pairs.
        align: alignment whose slot ``slot`` groups the pairs by expert id in [0, E_w) (blocks of
            other experts are skipped; one recorded for more experts or other pairs is refused).
        top_k: experts per token.
        num_pairs: M · top_k, the padding sentinel of ``align``.
        in_row_div: ``top_k`` when ``a`` has one row per token, 1 when one row per pair.
        slot: which slot row of ``align`` to read (0 for the base MoE and virtual experts).
        topk_weights: [num_pairs] (or [M, top_k], contiguous) router weights; multiplies rows.
        scale: fp32 vector; row scale is ``scale[e // experts_per_scale]`` (σ per slot).
        experts_per_weight: expert e reads ``w[e // experts_per_weight]`` (virtual experts over a
            factor stored once per slot: E); ``w`` then serves ``w.shape[0] · experts_per_weight`` ids.
        add_into: add to ``c`` instead of overwriting it.
        tf32: allow TF32 dots for fp32 (default IEEE).
        config: tile overrides (BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_SIZE_M: the program
            order, 0 = row blocks fastest, g > 0 = g row blocks across every column tile at a time;
            W_DESC: 1 = the weight tiles through a TMA descriptor where :func:`weight_descriptor` gives one;
            PDL: 1 = programmatic dependent launch, :func:`moelora_kernels._common.pdl_options`).
        bias: [E_w, N] per-expert bias (GPT-OSS's ``gate_up_proj_bias`` / ``down_proj_bias``; a
            strided column view is fine), same dtype as ``a`` or fp32; added in fp32 before the
            router weight and scale.

    Returns:
        ``c``.

    Raises:
        KernelPreconditionError: dtype / shape / stride / device mismatches, bad sizes; an alignment
            recorded for more experts than ``w`` or for another ``num_pairs``; ``GROUP_SIZE_M``,
            ``W_DESC`` or ``PDL`` out of range (``PDL`` 1 below sm_90).
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
    cfg = kernel_config("fused_moe_gemm", rows=num_pairs, N=N, K=K, overrides=config)
    group_size_m = check_group_size_m(cfg["GROUP_SIZE_M"])
    use_desc = check_config_choice(cfg, "W_DESC", W_DESC)
    pdl = pdl_options(cfg, device)
    if num_pairs == 0:
        return c
    grid_m = used_blocks_bound(num_pairs, E_w, block_m, num_blocks)
    grid = check_grid("fused_moe_gemm", (grid_m, triton.cdiv(N, cfg["BLOCK_N"])))
    w_desc = weight_descriptor(w, cfg["BLOCK_N"], cfg["BLOCK_K"]) if use_desc else None
    dummy = align.num_tokens_post_padded
    _fused_moe_gemm_kernel[grid](
        a, w if w_desc is None else w_desc, c,
        align.sorted_token_ids[slot], align.expert_ids[slot], align.num_tokens_post_padded[slot:slot + 1],
        topk_weights if topk_weights is not None else dummy,
        scale if scale is not None else dummy,
        bias if bias is not None else dummy,
        N, K, num_pairs, in_row_div, experts_per_scale, experts_per_weight, E_w,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        ADD_INTO=add_into, GROUP_SIZE_M=group_size_m, W_DESC=w_desc is not None, **pdl,
        **gemm_launch_options(dtype, tf32, cfg),
    )
    return c


#: The largest ``GROUP_SIZE_M`` the base GEMM takes (row blocks per program group; 0 = launch order).
MAX_GROUP_SIZE_M = 64


def check_group_size_m(value) -> int:
    """The config's ``GROUP_SIZE_M`` for the base GEMM's program order (:func:`fused_moe_gemm`).

    Raises:
        KernelPreconditionError: not an int in [0, :data:`MAX_GROUP_SIZE_M`].
    """
    if type(value) is not int or not 0 <= value <= MAX_GROUP_SIZE_M:
        raise KernelPreconditionError(f"GROUP_SIZE_M: must be an int in [0, {MAX_GROUP_SIZE_M}], got {value!r}")
    return value


#: Values of the base GEMM's ``W_DESC`` (module docstring): 0 = pointer loads, 1 = a TMA descriptor.
W_DESC: tuple[int, ...] = (0, 1)


#: The largest block side a TMA descriptor takes (elements; the hardware's box bound).
MAX_DESC_BLOCK = 256


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor | None:
    """A 2-D TMA descriptor over the rows of ``w`` [E_w', N, K] seen as [E_w' · N, K], block
    [``block_n``, ``block_k``], zero padding; ``None`` where the layout allows none, and the base GEMM
    then loads its weight tiles by pointer (the same values).

    A descriptor needs (the TMA unit's rules, as ``triton.tools.tensor_descriptor`` checks them): K
    contiguous (last stride 1), the expert stride equal to N times the row stride (rows of one expert
    follow the previous expert's: the rows form one matrix), the row stride and the base address
    multiples of 16 bytes, ``block_k`` elements a multiple of 16 bytes, both block sides powers of two
    of at most :data:`MAX_DESC_BLOCK`, and every row index an int32.

    Also the rule set of the MoE-LoRA shrink's A descriptor (:func:`moelora_kernels.moe_lora.lora_a_descriptor`,
    which passes the pool's A as [S·L·E, R, K]).

    Args:
        w: [E_w', N, K] fp32/fp16/bf16 weights of :func:`fused_moe_gemm` (any strides).
        block_n, block_k: the launch's BLOCK_N and BLOCK_K.
    """
    E_stored, N, K = w.shape
    item = w.element_size()
    rows = E_stored * N
    if w.stride(2) != 1 or (E_stored > 1 and w.stride(0) != N * w.stride(1)) or w.stride(1) < K:
        return None
    if (w.stride(1) * item) % 16 or w.data_ptr() % 16 or (block_k * item) % 16:
        return None
    if any(b < 1 or b & (b - 1) or b > MAX_DESC_BLOCK for b in (block_n, block_k)):
        return None
    if rows == 0 or K == 0 or rows + block_n >= 2 ** 31:
        return None
    return TensorDescriptor(w, shape=[rows, K], strides=[w.stride(1), 1], block_shape=[block_n, block_k])
