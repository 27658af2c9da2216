"""The Triton kernels of :mod:`moelora_kernels.mapping` (the launchers there check every precondition,
size the grids from capacities and document each tensor's shape, dtype, sentinels and rounding points;
the convention of this package: ``<op>.py`` launchers, ``_<op>_kernels.py`` their ``@triton.jit`` code)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _token_lora_mapping_kernel(
    # pointers
    req_seg_indptr_ptr,      # [bs + 1] int32
    req_weight_indices_ptr,  # [bs] int32
    token_lora_mapping_ptr,  # [num_tokens] int32, out
    adapter_enabled_ptr,     # [max_loras] int32, out
    # sizes
    num_requests,            # bs (capacity in graph mode)
    num_tokens,              # mapping length (token capacity in graph mode)
    max_loras,
    num_token_programs,
    # meta-parameters
    BLOCK_T: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,   # >= ceil(log2(bs + 1))
    BLOCK_REQ: tl.constexpr,
    L_PAD: tl.constexpr,          # power of two >= max_loras
):
    pid = tl.program_id(0)
    if pid < num_token_programs:
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        # invariant: req_seg_indptr[lo] <= t (req_seg_indptr[0] == 0) and the answer lies in [lo, hi]
        lo = tl.zeros([BLOCK_T], dtype=tl.int32)
        hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_requests
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            go_right = tl.load(req_seg_indptr_ptr + mid) <= t
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        live = lo < num_requests
        slot = tl.load(req_weight_indices_ptr + lo, mask=live, other=-1)
        tl.store(token_lora_mapping_ptr + t, tl.where(live, slot, -1), mask=t < num_tokens)
    else:
        slots = tl.arange(0, L_PAD)
        enabled = tl.zeros([L_PAD], dtype=tl.int32)
        for r0 in range(0, num_requests, BLOCK_REQ):
            r = r0 + tl.arange(0, BLOCK_REQ)
            ok = r < num_requests
            s = tl.load(req_weight_indices_ptr + r, mask=ok, other=-1)
            length = (tl.load(req_seg_indptr_ptr + r + 1, mask=ok, other=0)
                      - tl.load(req_seg_indptr_ptr + r, mask=ok, other=0))
            hit = (s[:, None] == slots[None, :]) & (length > 0)[:, None]
            enabled = tl.maximum(enabled, tl.max(hit.to(tl.int32), 0))
        tl.store(adapter_enabled_ptr + slots, enabled, mask=slots < max_loras)
