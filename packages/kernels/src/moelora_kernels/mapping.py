"""Token → adapter mapping and ``adapter_enabled`` from per-request segments, tail reset, no host sync.

Algorithm (one launch, grid ``(cdiv(num_tokens, BLOCK_T) + 1,)``):

- token programs: token t belongs to request r, the largest r with ``req_seg_indptr[r] <= t``, found
  by a binary search of a fixed number of steps (``ceil(log2(bs + 1))``, a host number); tokens at or
  past ``req_seg_indptr[bs]`` (the tail of a static graph buffer) get ``NO_ADAPTER``.
- the last program: a slot is enabled when some request with at least one token maps to it.

Tensors:

- ``req_seg_indptr`` [bs + 1] int32: token offsets per request, ``req_seg_indptr[0] == 0``,
  non-decreasing; graph tails equal the last live offset (empty requests).
- ``req_weight_indices`` [bs] int32: slot per request, NO_ADAPTER (-1) for base requests (graph tail -1).
  Values must lie in [-1, max_loras) (a host-side contract of ``BatchSpec``; not re-checked here).
- ``token_lora_mapping`` [num_tokens] int32 (out): slot per token, -1 = none, every element written.
- ``adapter_enabled`` [max_loras] int32 (out): 1 where a slot has tokens in this batch, else 0.

No floating point, no rounding. Source: SGLang's LoRA batch info (``token_lora_mapping``,
``adapter_enabled`` of the MoE-LoRA PR sgl-project/sglang#14105).
"""

from __future__ import annotations

import math

import torch
import triton

from moelora_core.errors import KernelPreconditionError
from moelora_kernels._common import check_grid, check_positive_int, check_tensor, next_pow2
from moelora_kernels._mapping_kernels import _token_lora_mapping_kernel


def token_lora_mapping(
    req_seg_indptr: torch.Tensor,
    req_weight_indices: torch.Tensor,
    *,
    max_loras: int,
    num_tokens: int | None = None,
    mapping_out: torch.Tensor | None = None,
    adapter_enabled_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the per-token slot and the per-slot enabled flag of a batch, on the device.

    Args:
        req_seg_indptr: [bs + 1] int32 token offsets per request (``LoRABatchInfo.req_seg_indptr``).
        req_weight_indices: [bs] int32 slot per request (``LoRABatchInfo.req_weight_indices``).
        max_loras: L, the number of slots.
        num_tokens: mapping length; defaults to ``mapping_out``'s length. Required without it.
        mapping_out: [num_tokens] int32 static buffer to write (allocated when None).
        adapter_enabled_out: [max_loras] int32 static buffer to write (allocated when None).

    Returns:
        (token_lora_mapping [num_tokens] int32, adapter_enabled [max_loras] int32), every element
        written (the mapping's tail past ``req_seg_indptr[bs]`` is -1).

    Raises:
        KernelPreconditionError: wrong dtypes, shapes, devices, contiguity; no token count.
    """
    check_positive_int("max_loras", max_loras)
    check_tensor("req_seg_indptr", req_seg_indptr, dtypes=(torch.int32,), dim=1, contiguous=True)
    device = req_seg_indptr.device
    bs = req_seg_indptr.shape[0] - 1
    if bs < 0:
        raise KernelPreconditionError("req_seg_indptr: needs bs + 1 >= 1 entries")
    check_tensor("req_weight_indices", req_weight_indices, dtypes=(torch.int32,), shape=(bs,), contiguous=True,
                 device=device)
    if mapping_out is None:
        if num_tokens is None:
            raise KernelPreconditionError("num_tokens: required when mapping_out is not given")
        check_positive_int("num_tokens", num_tokens, minimum=0)
        mapping_out = torch.empty(num_tokens, dtype=torch.int32, device=device)
    check_tensor("mapping_out", mapping_out, dtypes=(torch.int32,), dim=1, contiguous=True, device=device)
    if num_tokens is not None and mapping_out.shape[0] != num_tokens:
        raise KernelPreconditionError(f"mapping_out: length {mapping_out.shape[0]} != num_tokens {num_tokens}")
    num_tokens = mapping_out.shape[0]
    if adapter_enabled_out is None:
        adapter_enabled_out = torch.empty(max_loras, dtype=torch.int32, device=device)
    check_tensor("adapter_enabled_out", adapter_enabled_out, dtypes=(torch.int32,), shape=(max_loras,),
                 contiguous=True, device=device)
    block_t = 256 if num_tokens > 1024 else 64
    num_token_programs = triton.cdiv(num_tokens, block_t)
    check_grid("token_lora_mapping", (num_token_programs + 1,))
    steps = max(1, math.ceil(math.log2(bs + 1)))
    _token_lora_mapping_kernel[(num_token_programs + 1,)](
        req_seg_indptr, req_weight_indices, mapping_out, adapter_enabled_out,
        bs, num_tokens, max_loras, num_token_programs,
        BLOCK_T=block_t, SEARCH_STEPS=steps, BLOCK_REQ=min(256, next_pow2(bs, 16)),
        L_PAD=next_pow2(max_loras, 2),
    )
    return mapping_out, adapter_enabled_out
