"""Readable twins of the token→adapter mapping kernel (DESIGN.md §3, §4).

Math. With requests laid out one after another, request r owns the token rows
``[req_seg_indptr[r], req_seg_indptr[r + 1])`` and uses slot ``req_weight_indices[r]`` (``NO_ADAPTER`` = none):

    token_lora_mapping[t] = req_weight_indices[r]   for req_seg_indptr[r] <= t < req_seg_indptr[r + 1]
    token_lora_mapping[t] = NO_ADAPTER       for t >= req_seg_indptr[-1] (graph-capacity tail)
    adapter_enabled[s]    = 1 if some t has token_lora_mapping[t] == s else 0

In graph mode ``req_seg_indptr`` has ``capacity + 1`` entries whose tail equals the last live offset
(empty segments) and ``req_weight_indices`` is -1 in its tail, so the same rule resets the tail rows.

Source: SGLang's MoE-LoRA batch info (sgl-project/sglang#14105, ``token_lora_mapping`` built from
``req_seg_indptr`` and ``req_weight_indices``) and vLLM's ``token_lora_mapping`` in ``PunicaWrapperGPU``.

Loops are intentional: these twins are slow and obviously right; kernels are checked against them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.sentinels import NO_ADAPTER


def _as_int_list(name: str, values: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point():
            raise InvalidFieldError(name, f"must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def token_lora_mapping(
    req_seg_indptr: torch.Tensor | Sequence[int],
    req_weight_indices: torch.Tensor | Sequence[int],
    num_tokens: int,
) -> torch.Tensor:
    """The slot of every token row, from per-request segments.

    Args:
        req_seg_indptr: [S + 1] int token offsets, ``req_seg_indptr[0] == 0``, non-decreasing, last entry
            ``<= num_tokens`` (graph mode: ``S`` is the request capacity, tail = last live offset).
        req_weight_indices: [S] int slot per request, ``NO_ADAPTER`` (-1) = none.
        num_tokens: rows of the result (graph mode: the token capacity).

    Returns:
        [num_tokens] int32 on the CPU; rows past ``req_seg_indptr[-1]`` hold ``NO_ADAPTER``.

    Raises:
        InvalidFieldError: lengths that do not match, offsets that do not start at 0, decrease, or
            pass ``num_tokens``, or a slot below -1.
    """
    indptr = _as_int_list("req_seg_indptr", req_seg_indptr)
    slots = _as_int_list("req_weight_indices", req_weight_indices)
    if num_tokens < 0:
        raise InvalidFieldError("num_tokens", f"must be >= 0, got {num_tokens}")
    if len(indptr) != len(slots) + 1:
        raise InvalidFieldError(
            "req_seg_indptr", f"needs len(req_weight_indices) + 1 = {len(slots) + 1} entries, got {len(indptr)}"
        )
    if indptr[0] != 0:
        raise InvalidFieldError("req_seg_indptr[0]", f"must be 0, got {indptr[0]}")
    for r in range(len(slots)):
        if indptr[r + 1] < indptr[r]:
            raise InvalidFieldError(f"req_seg_indptr[{r + 1}]", f"offsets decrease: {indptr[r]} then {indptr[r + 1]}")
        if slots[r] < NO_ADAPTER:
            raise InvalidFieldError(f"req_weight_indices[{r}]", f"slot {slots[r]} is below NO_ADAPTER (-1)")
    if indptr[-1] > num_tokens:
        raise InvalidFieldError("req_seg_indptr[-1]", f"last offset {indptr[-1]} passes num_tokens={num_tokens}")

    out = torch.full((num_tokens,), NO_ADAPTER, dtype=torch.int32)
    for r, slot in enumerate(slots):
        for t in range(indptr[r], indptr[r + 1]):
            out[t] = slot
    return out


def adapter_enabled(token_lora_mapping: torch.Tensor | Sequence[int], max_loras: int) -> torch.Tensor:
    """1 for every slot some token uses, else 0.

    Args:
        token_lora_mapping: [T] int slot per token, ``NO_ADAPTER`` = none.
        max_loras: number of slots.

    Returns:
        [max_loras] int32 on the CPU.

    Raises:
        InvalidFieldError: a slot outside ``[-1, max_loras)``.
    """
    mapping = _as_int_list("token_lora_mapping", token_lora_mapping)
    out = torch.zeros(max_loras, dtype=torch.int32)
    for t, slot in enumerate(mapping):
        if not NO_ADAPTER <= slot < max_loras:
            raise InvalidFieldError(f"token_lora_mapping[{t}]", f"slot {slot} is outside [-1, max_loras={max_loras})")
        if slot != NO_ADAPTER:
            out[slot] = 1
    return out
