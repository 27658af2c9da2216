"""The Triton kernels of :mod:`moelora_kernels.virtual_experts` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _virtual_topk_ids_kernel(
    # pointers
    topk_ids_ptr,            # [M * top_k] int32/int64
    token_lora_mapping_ptr,  # [M] int32
    virtual_ids_ptr,         # [M * top_k] int32, out
    # sizes
    num_pairs, top_k, num_experts, max_loras,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = pairs < num_pairs
    e = tl.load(topk_ids_ptr + pairs, mask=ok, other=-1)
    slot = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=ok, other=-1)
    has_lora = (slot >= 0) & (slot < max_loras) & (e >= 0) & (e < num_experts)
    v = tl.where(has_lora, slot.to(tl.int64) * num_experts + e.to(tl.int64), -1)
    tl.store(virtual_ids_ptr + pairs, v.to(tl.int32), mask=ok)
