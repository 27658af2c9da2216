"""One-line faults in the reference backend that only sizes past the ``interpret`` caps reach.

The ``interpret`` and ``dev`` profiles draw top_k <= 2, R <= 16 and H, I <= 64 (DESIGN.md §7): a
backend that gives LoRA to the first two routed experts only, reads one 16-row rank tile or one
64-wide K tile is right on every case those caps allow. The properties still catch these faults —
P01 compares every row with the oracle — once the profile draws the sizes (``gpu``, ``soak``:
top_k <= 8, R <= 64, H <= 2048). They are kept apart from :data:`~.mutants.MUTANTS` (which the
``interpret`` run must catch) and loadable by name like the others
(``--backend moelora_conformance.faulty:make_lora_top2_only``); ``docs/mutations.md`` records which
profile catches each.
"""

from __future__ import annotations

import torch

from moelora_conformance.examples.torch_backend import TorchBackend
from moelora_reference.backend import ReferenceBackend


class LoRATop2Only(ReferenceBackend):
    """Mixtral-era top-2 assumption: only a token's first two routed experts get LoRA (needs top_k > 2)."""

    name = "mutant-lora-top2-only"
    needs = "top_k > 2"

    def _pair_index(self, topk_ids, info):
        valid, index, slot = super()._pair_index(topk_ids, info)
        first_two = torch.arange(topk_ids.shape[1], device=topk_ids.device) < 2  # FAULT: k < 2 only
        return valid & first_two, index, slot


class RankTile16(ReferenceBackend):
    """The MoE shrink reads one 16-row rank tile (no loop over rank tiles): rank rows >= 16 add nothing
    (needs R > 16)."""

    name = "mutant-rank-tile-16"
    needs = "R > 16"

    def _moe_factors(self, weights, module):
        A, B = super()._moe_factors(weights, module)
        return A * (torch.arange(A.shape[-2], device=A.device) < 16)[:, None].to(A.dtype), B  # FAULT: one tile


class ShrinkKTile64(ReferenceBackend):
    """The MoE shrink has no loop over K: only the first 64 input features enter A x (one BLOCK_K = 64
    tile; needs H or I > 64)."""

    name = "mutant-shrink-k-tile-64"
    needs = "H > 64 or I > 64"

    def _moe_factors(self, weights, module):
        A, B = super()._moe_factors(weights, module)
        return A * (torch.arange(A.shape[-1], device=A.device) < 64).to(A.dtype), B  # FAULT: one K tile


class Offsets32Bit(TorchBackend):
    """The production-style backend adding its gate_up delta through 32-bit element offsets
    (``pair · 2I + column`` in int32): rows whose offset passes 2³¹ wrap around and get another
    row's delta (needs the ``gpu`` profile's large-offset case: ``strategies.large_offsets``)."""

    name = "mutant-offsets-32-bit"
    needs = "row × stride >= 2^31 (gpu profile, large-offset case)"

    def moe_gate_up_delta(self, x, topk_ids, gate_up_out, weights, info, *, align=None):
        before = gate_up_out.clone()
        super().moe_gate_up_delta(x, topk_ids, gate_up_out, weights, info, align=align)
        T, k, N = gate_up_out.shape
        rows = torch.arange(T * k, device=x.device, dtype=torch.int32)
        # FAULT: row · stride in int32 (wraps past 2^31), then the wrapped row receives the delta
        offset = (rows * N).to(torch.int64) % gate_up_out.numel()
        delta = (gate_up_out - before).reshape(T * k, N)
        gate_up_out.copy_(before.reshape(T * k, N).index_add(0, offset // N, delta).reshape(T, k, N))


#: Mutation name → backend class (not in ``MUTANTS``: the ``interpret`` caps cannot reach them).
CAP_MUTANTS: dict[str, type] = {
    "lora-top2-only": LoRATop2Only,
    "rank-tile-16": RankTile16,
    "shrink-k-tile-64": ShrinkKTile64,
    "offsets-32-bit": Offsets32Bit,
}
