"""Readable twins of virtual expert ids (DESIGN.md §4).

A batch of tokens on L adapter slots and E experts can be run as one MoE of ``L * E`` "virtual"
experts: the pair (slot s, expert e) becomes expert ``s * E + e``, whose LoRA weights are row
``s * E + e`` of the ``[L, E, ...]`` stacks reshaped to ``[L * E, ...]`` (a view, no copy). Then
a single-slot alignment / grouped GEMM serves every adapter at once.

Math, per pair (t, j) with s = token_lora_mapping[t] and e = topk_ids[t, j]:

    virtual[t, j] = s * E + e   if s != NO_ADAPTER and 0 <= e < E
    virtual[t, j] = -1          otherwise (no adapter, expert not here, or an extra fused expert)

Sentinels are preserved as -1 and never land on another adapter's expert: id E of slot s would
otherwise read as expert 0 of slot s + 1.

Source: SGLang's virtual experts for MoE-LoRA (sgl-project/sglang#22122, ``--lora-use-virtual-experts``),
which flattens ``[max_loras, num_experts]`` into one expert space and masks tokens without an adapter.
"""

from __future__ import annotations

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.sentinels import NO_ADAPTER

#: The virtual id of a pair with no LoRA (any negative id means "nothing here").
NO_VIRTUAL_EXPERT = -1


def virtual_topk_ids(topk_ids: torch.Tensor, token_lora_mapping: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Virtual expert id ``slot * E + expert`` of every (token, k) pair.

    Args:
        topk_ids: [T, k] int expert ids (negative = not handled here; >= E = extra fused expert).
        token_lora_mapping: [T] int slot per token, ``NO_ADAPTER`` = none.
        num_experts: E.

    Returns:
        [T, k] tensor of ``topk_ids``' dtype on the CPU; -1 where the pair has no LoRA.

    Raises:
        InvalidFieldError: mismatched shapes, a float dtype, ``num_experts < 1`` or a slot < -1.
    """
    if topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise InvalidFieldError("topk_ids", f"must be a 2-D integer tensor, got {topk_ids.dtype} "
                                            f"{tuple(topk_ids.shape)}")
    if tuple(token_lora_mapping.shape) != (topk_ids.shape[0],) or token_lora_mapping.is_floating_point():
        raise InvalidFieldError("token_lora_mapping", f"must be an integer tensor of shape ({topk_ids.shape[0]},)")
    if num_experts < 1:
        raise InvalidFieldError("num_experts", f"must be >= 1, got {num_experts}")
    ids = topk_ids.tolist()
    mapping = token_lora_mapping.tolist()
    out = torch.full(tuple(topk_ids.shape), NO_VIRTUAL_EXPERT, dtype=topk_ids.dtype)
    for t, slot in enumerate(mapping):
        if slot < NO_ADAPTER:
            raise InvalidFieldError(f"token_lora_mapping[{t}]", f"slot {slot} is below NO_ADAPTER (-1)")
        if slot == NO_ADAPTER:
            continue
        for j, e in enumerate(ids[t]):
            if 0 <= e < num_experts:
                out[t, j] = slot * num_experts + e
    return out


def split_virtual_ids(virtual_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse for checks: (slot, expert) of every virtual id; both -1 where the id is negative.

    Args:
        virtual_ids: [...] int virtual expert ids.
        num_experts: E.

    Returns:
        (slot, expert), tensors of ``virtual_ids``' shape and dtype on the CPU.
    """
    if num_experts < 1:
        raise InvalidFieldError("num_experts", f"must be >= 1, got {num_experts}")
    flat = virtual_ids.reshape(-1).tolist()
    slots, experts = [], []
    for v in flat:
        if v < 0:
            slots.append(NO_ADAPTER)
            experts.append(NO_VIRTUAL_EXPERT)
        else:
            slots.append(v // num_experts)
            experts.append(v % num_experts)
    shape = tuple(virtual_ids.shape)
    return (torch.tensor(slots, dtype=virtual_ids.dtype).reshape(shape),
            torch.tensor(experts, dtype=virtual_ids.dtype).reshape(shape))
