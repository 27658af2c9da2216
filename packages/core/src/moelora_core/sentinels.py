"""Sentinel values with one meaning each across moelora (DESIGN.md §1, §3, §4).

``-1`` is used for three different "nothing here" meanings; they are spelled differently so a
reader sees which one a line means, even though the value is the same:

- ``NO_ADAPTER``: the adapter id of a base request and of its tokens (``token_lora_mapping``,
  ``weight_indices``, ``req_weight_indices``). It is never a slot: slots are ``0..max_loras-1``.
- ``EXPERT_NOT_HERE``: a routed expert id that this rank does not handle (expert parallelism).
  Any negative expert id means this; it contributes nothing to base or LoRA output.
- ``NO_EXPERT_BLOCK``: the expert id of an alignment block past the last used one.

Padding rows of ``moe_lora_align_block_size`` hold ``M * top_k`` (one past the last valid
(token, k) pair index) rather than a negative value, following the fused-MoE convention.
"""

from __future__ import annotations

from typing import Final

NO_ADAPTER: Final[int] = -1
EXPERT_NOT_HERE: Final[int] = -1
NO_EXPERT_BLOCK: Final[int] = -1


def padding_row(num_tokens: int, top_k: int) -> int:
    """The sentinel stored in padding rows of ``sorted_token_ids``: ``num_tokens * top_k``.

    Args:
        num_tokens: M, the token count of the batch (capacity in graph mode).
        top_k: experts per token.
    """
    return num_tokens * top_k
