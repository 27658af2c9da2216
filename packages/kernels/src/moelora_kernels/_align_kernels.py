"""The Triton kernels of :mod:`moelora_kernels.align` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code).

Two kernels, one algorithm: ``_moe_lora_align_block_size_kernel`` with ``SPLIT`` programs per slot
(grid ``(L, SPLIT)``); each program takes a contiguous share of ``pairs_per_part`` pairs. With
``SPLIT == 1`` the program counts its slot's pairs itself (one launch). With ``SPLIT > 1``
``_moe_lora_align_count_kernel`` (same grid) first writes one histogram per program into the
workspace; every program of the second kernel then reads its slot's ``SPLIT`` histograms, derives
the same layout (each program writes its share of it) and its own first row per expert (the expert's
first row plus the counts of the parts before it), and places its pairs from there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora_kernels._tiles import wait_for_producers


@triton.jit
def _slot_pairs(start, slot, topk_ids_ptr, token_lora_mapping_ptr, pair_end, top_k, num_experts,
                BLOCK_PAIRS: tl.constexpr, HAS_MAPPING: tl.constexpr):
    """(pairs, valid, e) of the chunk of pairs from ``start`` (below ``pair_end``): which belong to
    ``slot`` with an expert in [0, E) (counted, then placed), and their expert (0 where not valid)."""
    pairs = start + tl.arange(0, BLOCK_PAIRS)
    in_range = pairs < pair_end
    e_raw = tl.load(topk_ids_ptr + pairs, mask=in_range, other=-1)
    valid = in_range & (e_raw >= 0) & (e_raw < num_experts)
    if HAS_MAPPING:
        tok_slot = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=in_range, other=-1)
        valid = valid & (tok_slot == slot)
    return pairs, valid, tl.where(valid, e_raw, 0).to(tl.int32)


@triton.jit
def _part_range(slot, part, adapter_enabled_ptr, num_pairs, pairs_per_part, HAS_ENABLED: tl.constexpr):
    """[lo, hi): the pairs program ``part`` of ``slot`` scans; empty for a disabled slot."""
    lo = part * pairs_per_part
    hi = tl.minimum(lo + pairs_per_part, num_pairs)
    if HAS_ENABLED:
        if tl.load(adapter_enabled_ptr + slot) == 0:
            hi = lo
    return lo, hi


@triton.jit
def _count_pairs(slot, lo, hi, topk_ids_ptr, token_lora_mapping_ptr, top_k, num_experts,
                 E_PAD: tl.constexpr, BLOCK_PAIRS: tl.constexpr, HAS_MAPPING: tl.constexpr):
    """[E_PAD] int32: pairs of ``slot`` per expert among pairs [lo, hi)."""
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(lo, hi, BLOCK_PAIRS):
        _, valid, e = _slot_pairs(start, slot, topk_ids_ptr, token_lora_mapping_ptr, hi, top_k, num_experts,
                                  BLOCK_PAIRS, HAS_MAPPING)
        counts += tl.histogram(e, E_PAD, mask=valid)
    return counts


@triton.jit
def _moe_lora_align_count_kernel(
    # pointers
    topk_ids_ptr,            # [M * top_k] int32/int64
    token_lora_mapping_ptr,  # [M] int32 (unused without HAS_MAPPING)
    adapter_enabled_ptr,     # [L] int32 (unused without HAS_ENABLED)
    workspace_ptr,           # [L, 2, SPLIT, E_PAD] int32: [:, 0] the histograms, out
    # sizes
    num_pairs, top_k, num_experts, pairs_per_part,
    # meta-parameters
    E_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
    HAS_MAPPING: tl.constexpr, HAS_ENABLED: tl.constexpr,
    PDL: tl.constexpr,           # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    slot = tl.program_id(0)
    part = tl.program_id(1)
    lo, hi = _part_range(slot, part, adapter_enabled_ptr, num_pairs, pairs_per_part, HAS_ENABLED)
    counts = _count_pairs(slot, lo, hi, topk_ids_ptr, token_lora_mapping_ptr, top_k, num_experts,
                          E_PAD, BLOCK_PAIRS, HAS_MAPPING)
    # every histogram is written (zeros for a disabled slot): the layout kernel reads all of them
    tl.store(workspace_ptr + (slot.to(tl.int64) * 2 * SPLIT + part) * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _moe_lora_align_block_size_kernel(
    # pointers
    topk_ids_ptr,            # [M * top_k] int32/int64
    token_lora_mapping_ptr,  # [M] int32 (unused without HAS_MAPPING)
    adapter_enabled_ptr,     # [L] int32 (unused without HAS_ENABLED)
    sorted_token_ids_ptr,    # [L, P] int32, out
    expert_ids_ptr,          # [L, P // BLOCK_M] int32, out
    num_tokens_post_padded_ptr,  # [L] int32, out
    workspace_ptr,           # [L, 2, SPLIT, E_PAD] int32: [:, 0] histograms (SPLIT > 1), [:, 1] cursors
    # sizes
    num_pairs,               # M * top_k: also the padding sentinel
    top_k,
    num_experts,
    capacity,                # P rows per slot
    num_blocks,              # P // BLOCK_M
    pairs_per_part,          # pairs each of the SPLIT programs of a slot scans
    # strides (per slot row)
    stride_sorted,
    stride_expert_ids,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,         # power of two >= num_experts
    SPLIT: tl.constexpr,         # programs per slot (a power of two)
    BLOCK_PAIRS: tl.constexpr,   # pairs per chunk
    BLOCK_ROWS: tl.constexpr,    # rows (and blocks) per chunk of the layout phase
    HAS_MAPPING: tl.constexpr,   # False: every token belongs to slot 0 (the base MoE)
    HAS_ENABLED: tl.constexpr,
    PDL: tl.constexpr,           # launched with programmatic dependent launch: wait for the previous grid first
):
    wait_for_producers(PDL)
    slot = tl.program_id(0)
    part = tl.program_id(1)
    slot64 = slot.to(tl.int64)
    sorted_base = sorted_token_ids_ptr + slot64 * stride_sorted
    expert_base = expert_ids_ptr + slot64 * stride_expert_ids
    ws_base = workspace_ptr + slot64 * 2 * SPLIT * E_PAD
    cursor_base = ws_base + (SPLIT + part) * E_PAD
    experts = tl.arange(0, E_PAD)

    # A disabled slot scans no pair; it still writes its (empty) layout below.
    lo, hi = _part_range(slot, part, adapter_enabled_ptr, num_pairs, pairs_per_part, HAS_ENABLED)

    # --- 1. count pairs per expert: this slot's total, and the pairs of the parts before this one --
    if SPLIT == 1:
        counts = _count_pairs(slot, lo, hi, topk_ids_ptr, token_lora_mapping_ptr, top_k, num_experts,
                              E_PAD, BLOCK_PAIRS, HAS_MAPPING)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        parts = tl.arange(0, SPLIT)
        hist = tl.load(ws_base + parts[:, None] * E_PAD + experts[None, :])
        counts = tl.sum(hist, 0)
        # exclusive prefix over the parts: part p's pairs of expert e follow those of parts < p
        before = tl.sum(tl.where(parts[:, None] < part, hist, 0), 0)

    # --- 2. layout: padded sizes, first rows, block experts, padding rows (each part a share) -----
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    if part == 0:
        tl.store(num_tokens_post_padded_ptr + slot, total)
    tl.store(cursor_base + experts, starts + before)

    for b0 in range(part * BLOCK_ROWS, num_blocks, SPLIT * BLOCK_ROWS):
        blocks = b0 + tl.arange(0, BLOCK_ROWS)
        first_row = blocks * BLOCK_M
        # the block's expert is the number of experts whose rows end at or before it
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(expert_base + blocks, owner, mask=blocks < num_blocks)

    # the unused tail of each expert's last block (experts dealt round-robin over the parts)
    j = tl.arange(0, BLOCK_M)
    pad_rows = (starts + counts)[:, None] + j[None, :]
    mine = (experts % SPLIT) == part
    tl.store(sorted_base + pad_rows, tl.full([E_PAD, BLOCK_M], 0, tl.int32) + num_pairs,
             mask=(pad_rows < ends[:, None]) & mine[:, None])
    # every row past the last block (stale rows of a previous, larger batch included)
    for r0 in range(total + part * BLOCK_ROWS, capacity, SPLIT * BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        tl.store(sorted_base + rows, tl.full([BLOCK_ROWS], 0, tl.int32) + num_pairs, mask=rows < capacity)

    # the cursors must be in place before any program thread takes a row
    tl.debug_barrier()

    # --- 3. place every pair of this part at its expert's next free row ---------------------------
    # (a cursor row belongs to one program, so the atomics need only CTA scope)
    for start in range(lo, hi, BLOCK_PAIRS):
        pairs, valid, e = _slot_pairs(start, slot, topk_ids_ptr, token_lora_mapping_ptr, hi, top_k,
                                      num_experts, BLOCK_PAIRS, HAS_MAPPING)
        row = tl.atomic_add(cursor_base + e, 1, mask=valid, sem="relaxed", scope="cta")
        tl.store(sorted_base + row, pairs.to(tl.int32), mask=valid)
