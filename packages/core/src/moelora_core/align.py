"""The output contract of ``moe_lora_align_block_size`` (DESIGN.md §4), shared by the Triton
kernel (``moelora_kernels``) and its readable twin (``moelora_reference``).

For each adapter slot used by the batch, the (token, k) pairs routed to that slot are grouped by
expert and each expert's group is padded to a multiple of ``BLOCK_M``, so every block of
``BLOCK_M`` consecutive rows belongs to one (slot, expert):

- ``sorted_token_ids`` [max_loras, P] int32: flat pair index ``t * top_k + j`` per row; padding
  rows hold ``M * top_k`` (see :func:`moelora_core.sentinels.padding_row`). Rows past
  ``num_tokens_post_padded[slot]`` hold the padding value too. Order within an expert is free.
- ``expert_ids`` [max_loras, P // BLOCK_M] int32: the expert of each block; blocks past the last
  used one hold ``NO_EXPERT_BLOCK`` (-1).
- ``num_tokens_post_padded`` [max_loras] int32: rows used per slot (a multiple of BLOCK_M).

Skipped pairs (they appear in no slot): tokens mapped to ``NO_ADAPTER``, tokens of disabled slots,
expert ids < 0 or >= E. A disabled or unused slot has ``num_tokens_post_padded = 0``, all rows
padding and all blocks -1.

Capacity per slot: ``P = round_up(M * top_k + E * (BLOCK_M - 1), BLOCK_M)``, the worst case when
every expert's group needs ``BLOCK_M - 1`` padding rows. Buffers are sized from capacities (M is
the token capacity in graph mode), never from device values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def align_capacity(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """P, the per-slot row capacity: ``round_up(M * top_k + E * (BLOCK_M - 1), BLOCK_M)``."""
    raw = num_tokens * top_k + num_experts * (block_m - 1)
    return -(-raw // block_m) * block_m


class _AlignTensors(NamedTuple):
    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


class AlignOutput(_AlignTensors):
    """What ``moe_lora_align_block_size`` writes (shapes in the module docstring), and what the host
    knows about the launch that wrote it.

    A named tuple of the three tensors (construction, unpacking, iteration, ``_fields`` and
    ``_replace`` as before), plus two host attributes, ``None`` when unknown (an ``AlignOutput``
    built from tensors by hand, or rebuilt by ``_replace`` / ``_make``):

    - ``num_pairs``: M · top_k of the launch that wrote the buffers, the padding sentinel of
      ``sorted_token_ids``. A consumer launched on another pair count would take the sentinel for
      a real pair (or skip real ones), so consumers refuse a mismatch on the host.
    - ``num_experts``: E of that launch: ``expert_ids`` hold ids in [0, E) or -1.

    The launchers that write the buffers set both (:meth:`set_launch`), in place on the ``out`` they
    are given, so a static ``AlignOutput`` reused for a smaller batch says what it holds now.
    """

    #: M · top_k of the launch that wrote the buffers (the padding sentinel); None when unknown.
    num_pairs: int | None = None
    #: E of the launch that wrote the buffers; None when unknown.
    num_experts: int | None = None

    def set_launch(self, num_pairs: int, num_experts: int) -> AlignOutput:
        """Record the pair count and expert count of the launch writing these buffers; returns self."""
        self.num_pairs = int(num_pairs)
        self.num_experts = int(num_experts)
        return self

    @staticmethod
    def empty(max_loras: int, num_tokens: int, top_k: int, num_experts: int, block_m: int,
              device: torch.device | str = "cpu") -> AlignOutput:
        """Worst-case buffers filled with sentinels (padding rows, -1 blocks, 0 counts), recording
        ``num_tokens * top_k`` pairs and ``num_experts`` experts (what the sentinels stand for)."""
        cap = align_capacity(num_tokens, top_k, num_experts, block_m)
        return AlignOutput(
            torch.full((max_loras, cap), num_tokens * top_k, dtype=torch.int32, device=device),
            torch.full((max_loras, cap // block_m), -1, dtype=torch.int32, device=device),
            torch.zeros(max_loras, dtype=torch.int32, device=device),
        ).set_launch(num_tokens * top_k, num_experts)
