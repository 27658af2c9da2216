"""Launchers of the MoE-LoRA delta (kernels and tensor layouts in :mod:`._moe_lora_kernels`).

Three entry points with the stage ("gate_up" or "down") an explicit argument:

- :func:`fused_moe_lora_shrink` → the rank-wide intermediate [S, M·top_k, R];
- :func:`fused_moe_lora_expand` adds σ·B·t (router-weighted for "down") into the output;
- :func:`fused_moe_lora` does both in one kernel (the fast path: one launch per stage, t never
  leaves registers).

:func:`moe_lora_delta` takes a :class:`moelora_core.LoRAWeights` and picks the buffers, ranks and σ
of the stage. Grids come from capacities and host ints only: ``(bound on the used blocks of all
slots, 1, slices × column parts)``, each program finding its (block, slot) on the device; programs
of disabled slots, rank-0 modules, unused and -1 blocks exit at once. No launcher reads a device
value.

The config key ``EXPAND_STREAM`` of ``moe_lora_expand`` and ``fused_moe_lora``
(:mod:`moelora_kernels.expand_stream`) says how the expand reads its factor tiles: 0 masks them at
each slot's exact rank; >= 1 rounds the load mask up to 8 rank columns where the pool's R allows it,
so t and B come in 16-byte loads (the columns past the rank set to 0 in registers: the result is the
same bit for bit); >= 2 also software-pipelines the fused kernel's expand loop that many stages deep
(``_moe_lora_kernels`` module docstring: ``RANK_ALIGN``, ``EXPAND_STAGES``).

The config key ``A_DESC`` of ``moe_lora_shrink`` and ``fused_moe_lora``: 1 reads the shrink's A tiles
through a Hopper TMA tensor descriptor over the pool's A rows [S·L·E·R, K] (:func:`lora_a_descriptor`,
made on each launch) in every block whose slot's rank equals the tile's BLOCK_R, so the box is exactly
that slot's rank rows; a smaller rank, and a layout no descriptor describes (shared, stride-0 factors),
keep the masked pointer loads, so no block moves more bytes than at 0. The x rows stay gathered by
pointer. Same products, judged against the twin within tolerance (``test_kernel_a_desc.py``). The H100
table sets it on the pair's shrink at R 64 up to 256 rows (its A/B: ``ci/gpu/run_a_desc.sh``,
benchmarks/RESULTS.md); elsewhere 0. Source: the base GEMM's ``W_DESC``
(:mod:`moelora_kernels.fused_moe`) and SGLang's ``b_use_tma``.

The config key ``PDL`` of all three kernels (and of every other kernel of the layer, ``_common.PDL_OPS``):
1 launches the kernel with CUDA's programmatic dependent launch on sm_90 and newer
(:func:`~moelora_kernels._common.pdl_options`), so its programs are scheduled while the stream's
previous grid finishes and each waits for that grid's writes before its first load; at M ≤ 32 a
stage's launches cost as much as its work (benchmarks/RESULTS.md, the "idle" column). Same results
bit for bit (``test_kernel_pdl.py``).
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from moelora_core.align import AlignOutput, align_capacity
from moelora_core.errors import KernelPreconditionError
from moelora_core.weights import LoRAWeights, module_index
from moelora_kernels._common import (
    FLOAT_DTYPES,
    check_align_pairs,
    check_config_choice,
    check_grid,
    check_positive_int,
    check_rank_bound,
    check_rank_covers,
    check_tensor,
    gemm_launch_options,
    next_pow2,
    pdl_options,
)
from moelora_kernels._moe_lora_kernels import _fused_moe_lora_kernel, _moe_lora_expand_kernel, _moe_lora_shrink_kernel
from moelora_kernels.configs import kernel_config
from moelora_kernels.expand_stream import check_expand_stream, expand_stages, rank_align
from moelora_kernels.fused_moe import used_blocks_bound, weight_descriptor

STAGES: tuple[str, ...] = ("gate_up", "down")
#: Values of the fused kernel's ``EXPAND_LOADS``, when each expand tile's B tile and old output are
#: loaded: 0 = B at the tile, the old output after the dot; 1 = both together at the tile; 2 = both
#: one tile ahead (bit-identical results; the GPU table picks per row bucket)
EXPAND_LOADS: tuple[int, ...] = (0, 1, 2)
#: Values of the shrink's ``A_DESC`` (``moe_lora_shrink`` and ``fused_moe_lora``): 0 = masked pointer
#: loads of the A tiles; 1 = a TMA descriptor over the pool's A rows where :func:`lora_a_descriptor`
#: gives one, read by each block whose slot's rank is the tile's BLOCK_R (same products; the dot's
#: order may differ in the last bits, as ``fused_moe_gemm``'s ``W_DESC``)
A_DESC: tuple[int, ...] = (0, 1)
#: LoRAWeights modules of each stage.
STAGE_MODULES: dict[str, tuple[str, ...]] = {"gate_up": ("gate", "up"), "down": ("down",)}


class _Stage:
    """Validated, normalised arguments of one MoE-LoRA call (slices made explicit)."""

    def __init__(self, stage, x_rows, lora, ranks, scalings, align, top_k, num_experts, adapter_enabled,
                 max_rank, which, device, dtype):
        if stage not in STAGES:
            raise KernelPreconditionError(f"stage: {stage!r} not in {STAGES}")
        check_positive_int("top_k", top_k)
        self.stage = stage
        self.top_k = top_k
        self.slices = 2 if stage == "gate_up" else 1
        lead = 5 if stage == "gate_up" else 4
        check_tensor(which, lora, dtypes=(dtype,), dim=lead, unit_last_stride=True, device=device)
        self.lora = lora if stage == "gate_up" else lora.unsqueeze(0)
        if stage == "gate_up" and self.lora.shape[0] != 2:
            raise KernelPreconditionError(f"{which}: stage 'gate_up' needs 2 slices (gate, up) first, got "
                                          f"{self.lora.shape[0]}")
        _, self.L, self.E = self.lora.shape[:3]
        if num_experts is not None and num_experts != self.E:
            raise KernelPreconditionError(f"num_experts: {num_experts} != the weights' E={self.E}")
        self.ranks = _per_slice("ranks", ranks, stage, self.L, (torch.int32,), device)
        self.scalings = None if scalings is None else _per_slice("scalings", scalings, stage, self.L,
                                                                 (torch.float32,), device)
        # rows
        self.num_pairs = x_rows * top_k if stage == "gate_up" else x_rows
        if stage == "down" and x_rows % top_k:
            raise KernelPreconditionError(f"x: stage 'down' takes [M*top_k, I] rows; {x_rows} is not a multiple of "
                                          f"top_k={top_k}")
        self.in_row_div = top_k if stage == "gate_up" else 1
        self.M = self.num_pairs // top_k
        # alignment
        if not isinstance(align, AlignOutput):
            raise KernelPreconditionError(f"align: expected an AlignOutput, got {type(align).__name__}")
        check_tensor("align.sorted_token_ids", align.sorted_token_ids, dtypes=(torch.int32,), dim=2,
                     contiguous=True, device=device)
        P = align.sorted_token_ids.shape[1]
        nb = align.expert_ids.shape[-1]
        check_tensor("align.expert_ids", align.expert_ids, dtypes=(torch.int32,), shape=(self.L, nb),
                     contiguous=True, device=device)
        check_tensor("align.num_tokens_post_padded", align.num_tokens_post_padded, dtypes=(torch.int32,),
                     shape=(self.L,), contiguous=True, device=device)
        if align.sorted_token_ids.shape[0] != self.L:
            raise KernelPreconditionError(
                f"align: {align.sorted_token_ids.shape[0]} slot rows, but the weights have max_loras={self.L}")
        if nb == 0 or P % nb:
            raise KernelPreconditionError(f"align: {P} rows do not split into {nb} blocks")
        self.block_m = P // nb
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise KernelPreconditionError(f"align: BLOCK_M={self.block_m} must be a power of two >= 16")
        need = align_capacity(self.M, top_k, self.E, self.block_m)
        if P < need:
            raise KernelPreconditionError(f"align: {P} rows per slot < capacity {need} for M={self.M}, "
                                          f"top_k={top_k}, E={self.E}, BLOCK_M={self.block_m}")
        check_align_pairs(align, self.num_pairs)
        self.align = align
        self.num_blocks = nb
        if adapter_enabled is not None:
            check_tensor("adapter_enabled", adapter_enabled, dtypes=(torch.int32,), shape=(self.L,),
                         contiguous=True, device=device)
        self.adapter_enabled = adapter_enabled
        self.rank_bound = check_rank_bound(max_rank, self.lora.shape[3] if which == "lora_a" else self.lora.shape[4])
        self.block_r = next_pow2(self.rank_bound, 16)
        # per slot at most grid_m used blocks (the kernels clamp each slot's count to it)
        self.grid_m = used_blocks_bound(self.num_pairs, self.E, self.block_m, nb)
        # the used blocks of all slots on one axis: in all at most
        # Σ_s (n_s // BLOCK_M + min(E, n_s)) <= num_pairs // BLOCK_M + min(E · L, num_pairs)
        self.flat_grid_m = max(1, min(self.L * self.grid_m,
                                      self.num_pairs // self.block_m + min(self.E * self.L, self.num_pairs)))

    def block_grid(self, name: str, inner: int) -> tuple[tuple[int, int, int], dict]:
        """The launch grid over (used blocks of all slots, 1, ``inner``), and the kernel arguments
        that go with it (``_moe_lora_kernels`` module docstring)."""
        grid = (self.flat_grid_m, 1, inner)
        return check_grid(name, grid), {"L": self.L, "slot_blocks_bound": self.grid_m, "BLOCK_L": next_pow2(self.L)}

    def enabled_arg(self):
        return self.adapter_enabled if self.adapter_enabled is not None else self.align.num_tokens_post_padded


def _per_slice(name, t, stage, L, dtypes, device):
    """ranks / scalings as [S, L] with unit last stride."""
    want = (2, L) if stage == "gate_up" else (L,)
    check_tensor(name, t, dtypes=dtypes, shape=want, unit_last_stride=True, device=device)
    return t if stage == "gate_up" else t.unsqueeze(0)


def lora_a_descriptor(lora_a: torch.Tensor, block_r: int, block_k: int) -> TensorDescriptor | None:
    """A 2-D TMA descriptor over the A rows of a pool, block [``block_r``, ``block_k``]; ``None`` where
    the layout allows none (the shrink then loads its A tiles by pointer: the same values).

    ``lora_a`` [S, L, E, R, K] (a stage's A with its slices first, ``_Stage.lora``) is seen as
    [S · L · E · R, K]: the rank rows of (slice s, slot l, expert e) start at row ((s·L + l)·E + e)·R.
    That view needs the slices, slots and experts to follow each other without gaps (a stride-0 shared
    factor, or a view of a wider pool, has none: ``None``), and then the rules of
    :func:`moelora_kernels.fused_moe.weight_descriptor` (K contiguous, 16-byte row stride and base,
    power-of-two blocks, int32 rows).

    Args:
        lora_a: [S, L, E, R, K] fp32/fp16/bf16 (any strides).
        block_r, block_k: the launch's BLOCK_R and BLOCK_K.

    Raises nothing: a layout without a descriptor gives ``None``. Source: the base GEMM's ``W_DESC``
    descriptor (:func:`~moelora_kernels.fused_moe.weight_descriptor`), after SGLang's ``b_use_tma``.
    """
    S, L, E, R, K = lora_a.shape
    try:
        rows = lora_a.view(S * L * E, R, K)
    except RuntimeError:   # the leading dims do not merge without a copy
        return None
    return weight_descriptor(rows, block_r, block_k)


def _out_2d(out, st, width, dtype, device):
    """``out`` as [M·top_k, S·N] (a view; [M, top_k, S·N] is accepted), in x's dtype or fp32 (the
    epilogue adds in fp32 and rounds once to out's dtype: an fp32 output keeps the delta unrounded)."""
    check_tensor("out", out, dtypes=(dtype, torch.float32), unit_last_stride=True, device=device)
    shapes = ((st.num_pairs, width), (st.M, st.top_k, width))
    if tuple(out.shape) not in shapes:
        raise KernelPreconditionError(f"out: expected {list(shapes[1])} or {list(shapes[0])}, got {list(out.shape)}")
    try:
        return out.view(st.num_pairs, width)
    except RuntimeError:
        raise KernelPreconditionError(f"out: rows of shape {list(out.shape)} with strides {out.stride()} do not "
                                      f"merge into [M*top_k, {width}] without a copy") from None


def _routed(topk_weights, st, dtype, device):
    if st.stage == "down":
        if topk_weights is None:
            raise KernelPreconditionError("topk_weights: stage 'down' is router-weighted; pass [M, top_k] weights")
        check_tensor("topk_weights", topk_weights, dtypes=(torch.float32, dtype), contiguous=True, device=device)
        if topk_weights.numel() != st.num_pairs:
            raise KernelPreconditionError(f"topk_weights: {topk_weights.numel()} elements for {st.num_pairs} pairs")
        return topk_weights
    if topk_weights is not None:
        raise KernelPreconditionError("topk_weights: stage 'gate_up' is not router-weighted (the router weight "
                                      "multiplies the down projection)")
    return None


def _check_x(x, stage):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dim=2, unit_last_stride=True)
    return x.device, x.dtype


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
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """t[s, p] = A[s, slot(p), e(p)] · in[p] for every aligned pair, rank-wide, in x's dtype.

    Args:
        x: gate_up: [M, H] tokens; down: [M·top_k, I] activated intermediate per pair. Last stride 1.
        lora_a: gate_up: [2, L, E, R, H] (``LoRAWeights.gate_up_A``); down: [L, E, R, I] (``down_A``).
        align: the ``moe_lora_align_block_size`` output for these pairs.
        stage: "gate_up" or "down".
        top_k: experts per token.
        ranks: gate_up: [2, L] int32 (``module_ranks[0:2]``); down: [L] (``module_ranks[2]``).
        adapter_enabled: [L] int32 or None.
        out: [S, M·top_k, R] intermediate in x's dtype (allocated, uninitialised, when None); only
            rows of aligned pairs are written.
        max_rank: host bound on every active slot's rank (<= R); tiles are sized for it.
        tf32, config: dot precision for fp32; tile overrides (table ``moe_lora_shrink``: ``BLOCK_K``,
            ``A_DESC``, ``PDL``, ``num_warps``, ``num_stages``).

    Returns:
        The intermediate [S, M·top_k, R].

    Raises:
        KernelPreconditionError: dtype, shape, stride, device, capacity mismatches; max_rank > R;
            ``A_DESC`` not one of :data:`A_DESC`; ``PDL`` not one of
            :data:`~moelora_kernels._common.PDL`, or 1 below sm_90 (nothing is written, at any batch size).
    """
    device, dtype = _check_x(x, stage)
    st = _Stage(stage, x.shape[0], lora_a, ranks, None, align, top_k, None, adapter_enabled, max_rank,
                "lora_a", device, dtype)
    K, R = st.lora.shape[4], st.lora.shape[3]
    if x.shape[1] != K:
        raise KernelPreconditionError(f"x: {x.shape[1]} columns, but lora_a's input width is {K}")
    cfg = kernel_config("moe_lora_shrink", rows=st.num_pairs, K=K, R=st.rank_bound, overrides=config)
    use_desc = check_config_choice(cfg, "A_DESC", A_DESC)
    pdl = pdl_options(cfg, device)
    shape = (st.slices, st.num_pairs, R)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    check_tensor("out", out, dtypes=(dtype,), shape=shape, unit_last_stride=True, device=device)
    if st.num_pairs == 0:
        return out
    grid, flat = st.block_grid("fused_moe_lora_shrink", st.slices)
    a = st.lora
    a_desc = lora_a_descriptor(a, st.block_r, cfg["BLOCK_K"]) if use_desc else None
    _moe_lora_shrink_kernel[grid](
        x, a, a_desc, out,
        align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded, st.enabled_arg(), st.ranks,
        K, R, st.rank_bound, st.num_pairs, st.in_row_div, st.E,
        x.stride(0),
        a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        out.stride(0), out.stride(1),
        align.sorted_token_ids.stride(0), align.expert_ids.stride(0), st.ranks.stride(0),
        flat["L"], flat["slot_blocks_bound"],
        BLOCK_M=st.block_m, BLOCK_R=st.block_r, BLOCK_K=cfg["BLOCK_K"], BLOCK_L=flat["BLOCK_L"],
        A_DESC=a_desc is not None, **pdl,
        HAS_ENABLED=adapter_enabled is not None, **gemm_launch_options(dtype, tf32, cfg),
    )
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
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """out[p, s·N:(s+1)·N] += σ[s, slot] · w_p · B[s, slot, e] · t[s, p] for every aligned pair.

    Args:
        intermediate: from :func:`fused_moe_lora_shrink`: [S, M·top_k, R] in lora_b's dtype.
        lora_b: gate_up: [2, L, E, I, R] (``gate_up_B``); down: [L, E, H, R] (``down_B``).
        align: as for the shrink.
        out: gate_up: [M, top_k, 2I] (or [M·top_k, 2I]); down: [M, top_k, H]; added into in place;
            in lora_b's dtype or fp32.
        stage, top_k, ranks, adapter_enabled, max_rank: as for the shrink.
        scalings: gate_up: [2, L] fp32 (``module_scalings[0:2]``); down: [L] (``module_scalings[2]``).
        topk_weights: down only: [M, top_k] router weights (fp32 or the activation dtype).

    Block config (table ``moe_lora_expand``, or ``config``): ``BLOCK_N``, ``EXPAND_STREAM`` (>= 1
    loads t and B in 16-byte vectors; one tile per program, so no loop to pipeline), ``PDL``
    (programmatic dependent launch: :func:`~moelora_kernels._common.pdl_options`), ``num_warps``,
    ``num_stages``.

    Returns:
        ``out``.

    Raises:
        KernelPreconditionError: as the shrink; a missing (down) or extra (gate_up) topk_weights;
            ``EXPAND_STREAM`` not a value of
            :data:`~moelora_kernels.expand_stream.EXPAND_STREAM`; ``PDL`` not one of
            :data:`~moelora_kernels._common.PDL`, or 1 below sm_90 (nothing is written, at any batch size).
    """
    check_tensor("intermediate", intermediate, dtypes=FLOAT_DTYPES, dim=3, unit_last_stride=True)
    device, dtype = intermediate.device, intermediate.dtype
    st = _Stage(stage, intermediate.shape[1] // top_k if stage == "gate_up" else intermediate.shape[1],
                lora_b, ranks, scalings, align, top_k, None, adapter_enabled, max_rank, "lora_b", device, dtype)
    N, R = st.lora.shape[3], st.lora.shape[4]
    check_tensor("intermediate", intermediate, shape=(st.slices, st.num_pairs, R))
    out2 = _out_2d(out, st, st.slices * N, dtype, device)
    weights = _routed(topk_weights, st, dtype, device)
    # the config is checked before the empty-batch return: a bad value is refused at any batch size
    cfg = kernel_config("moe_lora_expand", rows=st.num_pairs, N=N, R=st.rank_bound, overrides=config)
    stream = check_expand_stream(cfg)
    pdl = pdl_options(cfg, device)
    if st.num_pairs == 0:
        return out
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])  # 0 for a slice of width 0: an empty grid
    grid, flat = st.block_grid("fused_moe_lora_expand", st.slices * n_tiles)
    b = st.lora
    _moe_lora_expand_kernel[grid](
        intermediate, b, out2, weights if weights is not None else st.scalings,
        align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded, st.enabled_arg(), st.ranks,
        st.scalings,
        N, st.rank_bound, st.num_pairs, st.E, n_tiles,
        intermediate.stride(0), intermediate.stride(1),
        b.stride(0), b.stride(1), b.stride(2), b.stride(3),
        out2.stride(0), N, 1,
        align.sorted_token_ids.stride(0), align.expert_ids.stride(0), st.ranks.stride(0), st.scalings.stride(0),
        flat["L"], flat["slot_blocks_bound"],
        BLOCK_M=st.block_m, BLOCK_R=st.block_r, BLOCK_N=cfg["BLOCK_N"], BLOCK_L=flat["BLOCK_L"],
        RANK_ALIGN=rank_align(stream, R), **pdl,
        HAS_ENABLED=adapter_enabled is not None, MUL_ROUTED_WEIGHT=weights is not None,
        **gemm_launch_options(dtype, tf32, cfg),
    )
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
    tf32: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """Shrink and expand in one kernel: out += σ · w · B (A in) per aligned pair (module docstring).

    Block config (table ``fused_moe_lora`` per (N, R, row bucket), or ``config``): ``BLOCK_K``,
    ``BLOCK_N``, ``N_SPLIT`` (programs sharing one block's N columns), ``EXPAND_LOADS`` (when each
    expand tile's B and old output are loaded: :data:`EXPAND_LOADS`), ``EXPAND_STREAM`` (how the
    expand reads B; >= 2 pipelines the expand loop as deep as fits an sm_90 block's shared memory,
    :func:`~moelora_kernels.expand_stream.expand_stages`, and leaves ``EXPAND_LOADS`` unused),
    ``A_DESC`` (the shrink's A tiles through a TMA descriptor: module docstring), ``PDL``
    (programmatic dependent launch: :func:`~moelora_kernels._common.pdl_options`), ``num_warps``,
    ``num_stages``. The result does not depend on them beyond the fp32 summation
    order (on ``EXPAND_LOADS`` and ``EXPAND_STREAM`` not even on that).

    Args: as :func:`fused_moe_lora_shrink` (x, lora_a) and :func:`fused_moe_lora_expand` (lora_b,
    out, scalings, topk_weights). The rank bound of both factors is ``max_rank`` (or R).

    Returns:
        ``out``.

    Raises:
        KernelPreconditionError: as the shrink and the expand; A and B of different pools;
            ``EXPAND_LOADS`` not one of
            :data:`EXPAND_LOADS`; ``EXPAND_STREAM`` not a value of
            :data:`~moelora_kernels.expand_stream.EXPAND_STREAM`; ``A_DESC`` not one of :data:`A_DESC`;
            ``PDL`` not one of :data:`~moelora_kernels._common.PDL`, or 1 below sm_90 (nothing is
            written).
    """
    device, dtype = _check_x(x, stage)
    st = _Stage(stage, x.shape[0], lora_a, ranks, scalings, align, top_k, None, adapter_enabled, max_rank,
                "lora_a", device, dtype)
    sb = _Stage(stage, x.shape[0], lora_b, ranks, scalings, align, top_k, st.E, adapter_enabled, max_rank,
                "lora_b", device, dtype)
    a, b = st.lora, sb.lora
    K, R, N = a.shape[4], a.shape[3], b.shape[3]
    if x.shape[1] != K:
        raise KernelPreconditionError(f"x: {x.shape[1]} columns, but lora_a's input width is {K}")
    if b.shape[:3] != a.shape[:3] or b.shape[4] != R:
        raise KernelPreconditionError(f"lora_b: shape {list(lora_b.shape)} does not pair with lora_a "
                                      f"{list(lora_a.shape)} (same slices, slots, experts and rank R)")
    out2 = _out_2d(out, st, st.slices * N, dtype, device)
    weights = _routed(topk_weights, st, dtype, device)
    # the config is checked before the empty-batch return: a bad value is refused at any batch size
    cfg = kernel_config("fused_moe_lora", rows=st.num_pairs, N=N, K=K, R=st.rank_bound, overrides=config)
    loads = check_config_choice(cfg, "EXPAND_LOADS", EXPAND_LOADS)
    use_desc = check_config_choice(cfg, "A_DESC", A_DESC)
    stream = check_expand_stream(cfg)
    pdl = pdl_options(cfg, device)
    if st.num_pairs == 0:
        return out
    a_desc = lora_a_descriptor(a, st.block_r, cfg["BLOCK_K"]) if use_desc else None
    stages = expand_stages(stream, block_m=st.block_m, block_r=st.block_r, block_n=cfg["BLOCK_N"],
                           b_bytes=b.element_size(), out_bytes=out2.element_size())
    grid, flat = st.block_grid("fused_moe_lora", st.slices * cfg["N_SPLIT"])
    _fused_moe_lora_kernel[grid](
        x, a, a_desc, b, out2, weights if weights is not None else st.scalings,
        align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded, st.enabled_arg(), st.ranks,
        st.scalings,
        K, N, R, st.rank_bound, st.num_pairs, st.in_row_div, st.E,
        x.stride(0),
        a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        b.stride(0), b.stride(1), b.stride(2), b.stride(3),
        out2.stride(0), N, 1,
        align.sorted_token_ids.stride(0), align.expert_ids.stride(0), st.ranks.stride(0), st.scalings.stride(0),
        flat["L"], flat["slot_blocks_bound"],
        BLOCK_M=st.block_m, BLOCK_R=st.block_r, BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        N_SPLIT=cfg["N_SPLIT"], BLOCK_L=flat["BLOCK_L"],
        EXPAND_LOADS=loads, RANK_ALIGN=rank_align(stream, R), EXPAND_STAGES=stages, A_DESC=a_desc is not None,
        **pdl, HAS_ENABLED=adapter_enabled is not None,
        MUL_ROUTED_WEIGHT=weights is not None,
        **gemm_launch_options(dtype, tf32, cfg),
    )
    return out


def stage_tensors(weights: LoRAWeights, stage: str) -> dict[str, torch.Tensor]:
    """The buffers, ranks and σ of ``stage`` in a ``LoRAWeights`` (views, no copies).

    Returns:
        ``lora_a``, ``lora_b``, ``ranks``, ``scalings`` as the launchers take them.

    Raises:
        KernelPreconditionError: unknown stage.
    """
    if stage == "gate_up":
        lo, hi = module_index("gate"), module_index("up") + 1
        return {"lora_a": weights.gate_up_A, "lora_b": weights.gate_up_B,
                "ranks": weights.module_ranks[lo:hi], "scalings": weights.module_scalings[lo:hi]}
    if stage == "down":
        return {"lora_a": weights.down_A, "lora_b": weights.down_B,
                "ranks": weights.ranks("down"), "scalings": weights.scalings("down")}
    raise KernelPreconditionError(f"stage: {stage!r} not in {STAGES}")


def moe_lora_delta(
    stage: str,
    x: torch.Tensor,
    out: torch.Tensor,
    weights: LoRAWeights,
    align: AlignOutput,
    *,
    top_k: int,
    topk_weights: torch.Tensor | None = None,
    adapter_enabled: torch.Tensor | None = None,
    max_rank: int | None = None,
    fused: bool | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Add the MoE-LoRA delta of ``stage`` from a ``LoRAWeights`` pool into ``out`` in place.

    ``fused=True`` runs :func:`fused_moe_lora` (one launch); ``False`` runs the shrink then the
    expand (two launches, an intermediate in memory); ``None`` picks by size from the config
    table (``moe_lora_path`` per row bucket and R, and the stage's N where an entry names it: on the
    H200 the pair wins at a few rows per bucket, where its column-parallel expand grid keeps more
    SMs busy). Both give the same result up to the fp32 rounding order of σ·w.

    Args:
        stage: "gate_up" (x [M, H], out [M, top_k, 2I]) or "down" (x = h [M·top_k, I], out
            [M, top_k, H], topk_weights [M, top_k]).
        weights: the pool (σ and ranks per module are read on the device at run time).
        max_rank: host rank bound; must cover every loaded slot's rank of the stage's modules
            (``weights.host_ranks``), None = the pool's R.
        align, top_k, adapter_enabled, tf32: as the launchers.

    Returns:
        ``out``.

    Raises:
        KernelPreconditionError: as the launchers; ``max_rank`` below a loaded slot's rank of the
            stage's modules.
    """
    t = stage_tensors(weights, stage)
    check_rank_covers(max_rank, weights, STAGE_MODULES[stage])
    if fused is None:
        pairs = x.shape[0] * top_k if stage == "gate_up" else x.shape[0]
        rank = max_rank if max_rank is not None else weights.spec.R
        # N: the stage's output width per slice, so a table entry may pick the path per stage
        n = weights.spec.I if stage == "gate_up" else weights.spec.H
        fused = bool(kernel_config("moe_lora_path", rows=pairs, N=n, R=rank)["FUSED"])
    if fused:
        return fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, stage=stage, top_k=top_k, ranks=t["ranks"],
                              scalings=t["scalings"], topk_weights=topk_weights, adapter_enabled=adapter_enabled,
                              max_rank=max_rank, tf32=tf32)
    inter = fused_moe_lora_shrink(x, t["lora_a"], align, stage=stage, top_k=top_k, ranks=t["ranks"],
                                  adapter_enabled=adapter_enabled, max_rank=max_rank, tf32=tf32)
    return fused_moe_lora_expand(inter, t["lora_b"], align, out, stage=stage, top_k=top_k, ranks=t["ranks"],
                                 scalings=t["scalings"], topk_weights=topk_weights,
                                 adapter_enabled=adapter_enabled, max_rank=max_rank, tf32=tf32)
