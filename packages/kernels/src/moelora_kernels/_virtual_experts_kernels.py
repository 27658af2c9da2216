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
    num_base_experts,        # EXPERT_MAJOR: E_base (ids in [E, E_base) are base experts without LoRA)
    # meta-parameters
    BLOCK: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr,  # ids of the fused-LoRA base GEMM: e·(L + 1) + slot, slot L for no LoRA
):
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = pairs < num_pairs
    e = tl.load(topk_ids_ptr + pairs, mask=ok, other=-1)
    slot = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=ok, other=-1)
    has_lora = (slot >= 0) & (slot < max_loras) & (e >= 0) & (e < num_experts)
    if EXPERT_MAJOR:
        # every pair of a base expert keeps its group (the base GEMM must reach it); a sentinel
        # slot never becomes a real one: it joins the no-LoRA group L
        group = tl.where(has_lora, slot.to(tl.int64), max_loras)
        v = tl.where((e >= 0) & (e < num_base_experts), e.to(tl.int64) * (max_loras + 1) + group, -1)
    else:
        v = tl.where(has_lora, slot.to(tl.int64) * num_experts + e.to(tl.int64), -1)
    tl.store(virtual_ids_ptr + pairs, v.to(tl.int32), mask=ok)
