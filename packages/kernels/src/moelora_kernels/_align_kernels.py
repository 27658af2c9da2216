"""The Triton kernels of :mod:`moelora_kernels.align` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_pairs(start, slot, topk_ids_ptr, token_lora_mapping_ptr, num_pairs, top_k, num_experts,
                BLOCK_PAIRS: tl.constexpr, HAS_MAPPING: tl.constexpr):
    """(pairs, valid, e) of the chunk of pairs from ``start``: which belong to ``slot`` with an
    expert in [0, E) (phase 1 counts them, phase 3 places them), and their expert (0 where not valid)."""
    pairs = start + tl.arange(0, BLOCK_PAIRS)
    in_range = pairs < num_pairs
    e_raw = tl.load(topk_ids_ptr + pairs, mask=in_range, other=-1)
    valid = in_range & (e_raw >= 0) & (e_raw < num_experts)
    if HAS_MAPPING:
        tok_slot = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=in_range, other=-1)
        valid = valid & (tok_slot == slot)
    return pairs, valid, tl.where(valid, e_raw, 0).to(tl.int32)


@triton.jit
def _moe_lora_align_block_size_kernel(
    # pointers
    topk_ids_ptr,            # [M * top_k] int32/int64
    token_lora_mapping_ptr,  # [M] int32 (unused without HAS_MAPPING)
    adapter_enabled_ptr,     # [L] int32 (unused without HAS_ENABLED)
    sorted_token_ids_ptr,    # [L, P] int32, out
    expert_ids_ptr,          # [L, P // BLOCK_M] int32, out
    num_tokens_post_padded_ptr,  # [L] int32, out
    cursor_ptr,              # [L, E_PAD] int32, scratch
    # sizes
    num_pairs,               # M * top_k: also the padding sentinel
    top_k,
    num_experts,
    capacity,                # P rows per slot
    num_blocks,              # P // BLOCK_M
    # strides (per slot row)
    stride_sorted,
    stride_expert_ids,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,         # power of two >= num_experts
    BLOCK_PAIRS: tl.constexpr,   # pairs per chunk
    BLOCK_ROWS: tl.constexpr,    # rows (and blocks) per chunk of the layout phase
    HAS_MAPPING: tl.constexpr,   # False: every token belongs to slot 0 (the base MoE)
    HAS_ENABLED: tl.constexpr,
):
    slot = tl.program_id(0)
    slot64 = slot.to(tl.int64)
    sorted_base = sorted_token_ids_ptr + slot64 * stride_sorted
    expert_base = expert_ids_ptr + slot64 * stride_expert_ids
    cursor_base = cursor_ptr + slot64 * E_PAD

    # A disabled slot scans no pair; it still writes its (empty) layout below.
    pair_end = num_pairs
    if HAS_ENABLED:
        if tl.load(adapter_enabled_ptr + slot) == 0:
            pair_end = 0

    # --- 1. count pairs per expert -----------------------------------------------------------
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, pair_end, BLOCK_PAIRS):
        _, valid, e = _slot_pairs(start, slot, topk_ids_ptr, token_lora_mapping_ptr, num_pairs, top_k, num_experts,
                                  BLOCK_PAIRS, HAS_MAPPING)
        counts += tl.histogram(e, E_PAD, mask=valid)

    # --- 2. layout: padded sizes, first rows, block experts, padding rows ----------------------
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_tokens_post_padded_ptr + slot, total)
    experts = tl.arange(0, E_PAD)
    tl.store(cursor_base + experts, starts)

    for b0 in range(0, num_blocks, BLOCK_ROWS):
        blocks = b0 + tl.arange(0, BLOCK_ROWS)
        first_row = blocks * BLOCK_M
        # the block's expert is the number of experts whose rows end at or before it
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(expert_base + blocks, owner, mask=blocks < num_blocks)

    # the unused tail of each expert's last block
    j = tl.arange(0, BLOCK_M)
    pad_rows = (starts + counts)[:, None] + j[None, :]
    tl.store(sorted_base + pad_rows, tl.full([E_PAD, BLOCK_M], 0, tl.int32) + num_pairs,
             mask=pad_rows < ends[:, None])
    # every row past the last block (stale rows of a previous, larger batch included)
    for r0 in range(total, capacity, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        tl.store(sorted_base + rows, tl.full([BLOCK_ROWS], 0, tl.int32) + num_pairs, mask=rows < capacity)

    # the cursors must be in place before any program thread takes a row
    tl.debug_barrier()

    # --- 3. place every pair at its expert's next free row ---------------------------------------
    for start in range(0, pair_end, BLOCK_PAIRS):
        pairs, valid, e = _slot_pairs(start, slot, topk_ids_ptr, token_lora_mapping_ptr, num_pairs, top_k,
                                      num_experts, BLOCK_PAIRS, HAS_MAPPING)
        row = tl.atomic_add(cursor_base + e, 1, mask=valid, sem="relaxed", scope="cta")
        tl.store(sorted_base + row, pairs.to(tl.int32), mask=valid)
