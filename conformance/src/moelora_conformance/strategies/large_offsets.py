"""The large-offset case: element offsets past 2³¹ in the MoE and the dense paths (``gpu`` profile).

A kernel that computes ``row · stride`` in 32 bits is right on every case the CPU profiles draw and
writes (or reads) the wrong rows once the product passes 2³¹ (DESIGN.md §4: "64-bit offsets where a
product can pass 2^31"). No drawn shape of the ``gpu`` profile reaches that (8192 tokens), so the
profile also draws — in P01's eager items, one example in 16 where the caps say ``large_offsets`` —
:func:`large_offset_case`: 140 000 tokens, top-8 of 8 experts, I = 1024 (``gate_up_out``
[T, 8, 2048]: pair row × 2I passes 2³¹), and a q projection of 16 384 outputs (T × 16 384 passes
2³¹), the last request on an adapter, so the rows the oracle checks (every request's first and last
token) lie past the 32-bit range. H = 64 keeps the weights small; the fp32 temporaries of the harness and
the reference backend reach tens of GB of device memory (estimated; an H200 has 141 GB).
:func:`offsets` gives the products for a test on a CPU.
"""

from __future__ import annotations

import torch

from moelora_conformance.strategies.adapters import SlotAdapter, pool_ranks, pool_scalings
from moelora_conformance.strategies.batches import BatchPlan
from moelora_conformance.strategies.cases import MoELoRACase
from moelora_conformance.strategies.routing import RoutingPlan
from moelora_conformance.strategies.shapes import LayerShape
from moelora_core.batch import BatchSpec, Request
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER

#: Tokens of the case: T · top_k · 2I and T · 16384 pass 2³¹.
TOKENS = 140_000
SHAPE = LayerShape(hidden_size=64, moe_intermediate_size=1024, num_experts=8, num_base_experts=8, top_k=8,
                   dense_shapes=(("q", (64, 16384)),), max_loras=2, max_rank=16, name="large-offset")
#: The requests (slot, tokens): a long base prefill, then two adapter requests ending at the last row.
REQUESTS = ((NO_ADAPTER, 90_000), (0, 49_950), (1, 50))


def offsets(case: MoELoRACase) -> dict[str, int]:
    """The largest element offset (row · row stride + last column) of the case's big tensors."""
    s, T = case.shape, case.batch.num_tokens
    I, k = s.moe_intermediate_size, s.top_k  # noqa: E741
    out = {"gate_up_out": (T * k - 1) * 2 * I + 2 * I - 1, "down_out": (T * k - 1) * s.hidden_size + s.hidden_size - 1}
    for m, (_, fout) in s.dense_shapes:
        out[f"dense {m} out"] = (T - 1) * fout + fout - 1
    return out


def large_offset_case(dtype: torch.dtype, *, seed: int, sigma: float = 4 / 3) -> MoELoRACase:
    """The large-offset case in ``dtype`` (module docstring); values from ``seed``."""
    pool = tuple(SlotAdapter(r, sigma * r, False, tuple((m, r, sigma * r) for m in ("gate", "up", "down", "q")))
                 for r in (16, 7))
    batch = BatchSpec(ForwardMode.EXTEND, [Request(slot, n) for slot, n in REQUESTS], 2, pool_ranks(pool),
                      pool_scalings(pool))
    routing = RoutingPlan("uniform", 8, 8, 8, True, None, (), 0.0, seed)
    return MoELoRACase(SHAPE, dtype, False, pool, BatchPlan(batch, "extend", "large-offset", "large"), routing, seed)
