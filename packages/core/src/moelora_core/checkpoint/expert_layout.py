"""Which expert layout an adapter's expert factors follow, read from each factor's expert count.

Layouts (``moelora_core.EXPERT_LAYOUTS``; conformance/docs/checkpoints.md) by the expert counts
(E_A, E_B) of each stage's factors, E the model's experts:

============  ==============  ==============  ==================================================
stage         per_expert      shared_outer    fully_shared
============  ==============  ==============  ==================================================
gate_up       (E, E)          (1, E)          (1, 1)
down          (E, E)          (E, 1)          (1, 1)
============  ==============  ==============  ==================================================

The count comes from the factor's expert dimension, never from the hidden or intermediate sizes:
the leading dim of a 3-D tensor (``A [E_A, r, in]``, ``B [E_B, out, r]``), or, for PEFT's 2-D fused
layout, the rows of ``A [E_A·r, in]`` and the columns of ``B [out, r·E_B]`` divided by the module's
rank from the config. With E = 1 every layout is the same and the adapter reads as per-expert.

Refused with :class:`~moelora_core.checkpoint.errors.ExpertLayoutError`: a stage whose shared side
is the wrong factor ((E, 1) on gate_up, (1, E) on down: no serving contract has it), and stages that
disagree on the layout (a factor shared on some layers only, shared-outer gate_up with a per-expert
down, ...). A count other than 1 or E is left to the shape check (reported against the per-expert
shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moelora_core.checkpoint.errors import ExpertLayoutError

_LAYOUT_OF = {
    "gate_up": {"EE": "per_expert", "1E": "shared_outer", "11": "fully_shared"},
    "down": {"EE": "per_expert", "E1": "shared_outer", "11": "fully_shared"},
}


@dataclass(frozen=True)
class StageCounts:
    """The expert counts of one stage's factors on one layer (``where`` names its keys in messages)."""

    layer: int
    stage: str  # "gate_up" | "down"; legacy per-expert modules count as per-expert stages
    count_A: int
    count_B: int
    where: str


def expert_count(encoding: str, factor: str, shape: Sequence[int], rank: int, num_experts: int) -> int:
    """The expert count of one factor: 1 (shared) or ``num_experts`` (a count that is neither, or a
    shape that shows none, reads as per-expert, for the shape check to report).

    Args:
        encoding: "packed" (3-D: the leading dim) or "fused" (PEFT 2-D: A's rows or B's columns
            over ``rank``).
        factor: "A" or "B".
        shape: the stored shape.
        rank: the module's rank from the config.
        num_experts: the model's E.
    """
    if encoding == "packed":
        n = shape[0] if len(shape) == 3 else num_experts
    elif len(shape) == 2 and rank > 0:
        width = shape[0] if factor == "A" else shape[1]
        n = width // rank if width % rank == 0 else num_experts
    else:
        n = num_experts
    return 1 if n == 1 else num_experts


def detect_expert_layout(stages: Sequence[StageCounts], num_experts: int, adapter: str) -> str:
    """The one expert layout of ``stages`` (module table), "per_expert" when there are none.

    Raises:
        ExpertLayoutError: a stage shared on the wrong side, or stages of different layouts.
    """
    if num_experts == 1 or not stages:
        return "per_expert"
    found: dict[str, list[StageCounts]] = {}
    for s in stages:
        code = ("1" if s.count_A == 1 else "E") + ("1" if s.count_B == 1 else "E")
        layout = _LAYOUT_OF[s.stage].get(code)
        if layout is None:
            shared, per = ("lora_B", "lora_A") if s.stage == "gate_up" else ("lora_A", "lora_B")
            raise ExpertLayoutError(
                adapter, s.where,
                f"{s.stage} has {shared} shared by all experts (expert count 1) and {per} per expert: the shared "
                f"side is the wrong factor (shared-outer shares gate_up lora_A, hidden -> rank, and down lora_B, "
                f"rank -> hidden)", expected="gate_up (1, E) / down (E, 1), or all E, or all 1",
                found=f"(lora_A, lora_B) expert counts ({s.count_A}, {s.count_B})")
        found.setdefault(layout, []).append(s)
    if len(found) > 1:
        parts = "; ".join(f"{layout}: " + ", ".join(f"layer {s.layer} {s.stage}" for s in items[:4])
                          + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")
                          for layout, items in sorted(found.items()))
        raise ExpertLayoutError(adapter, "expert factors", "the expert factors do not share one layout (a factor "
                                "shared by all experts on some layers or stages only)", found=parts)
    return next(iter(found))
