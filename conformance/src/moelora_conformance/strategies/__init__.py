"""Hypothesis strategies of moelora (DESIGN.md §7): Hypothesis draws structure and a seed; a
``torch.Generator`` seeded from it draws the values.

Sizes respect the loaded profile's caps (``current_profile().caps``) unless caps are passed.

- :func:`moe_lora_cases` → :class:`MoELoRACase` (shape, dtype, pool, batch, routing, seed) with
  ``materialize(device)`` and ``describe()``: what backend properties draw.
- Smaller pieces for kernel tests: :func:`layer_shapes`, :func:`dtypes`, :func:`adapter_pools`, :func:`sigmas`,
  :func:`batch_plans` / :func:`batch_specs`, :func:`routing_plans`, :func:`align_problems`.
- :func:`capped` bounds a profile's caps (tests whose check cannot follow the ``gpu`` sizes).
"""

from moelora_conformance.strategies.adapters import (
    MODULE_LAYOUTS,
    SlotAdapter,
    adapter_pools,
    pool_ranks,
    pool_scalings,
    sigmas,
    slot_adapters,
)
from moelora_conformance.strategies.align import ENABLED_MODES, AlignProblem, align_problems
from moelora_conformance.strategies.batches import (
    ADAPTER_MODES,
    FORWARD_KINDS,
    SIZE_CLASSES,
    BatchPlan,
    batch_plans,
    batch_specs,
)
from moelora_conformance.strategies.cases import DENSE_LAYOUTS, MaterializedCase, MoELayer, MoELoRACase, moe_lora_cases
from moelora_conformance.strategies.routing import ROUTING_MODES, SENTINEL_SHARES, RoutingPlan, routing_plans
from moelora_conformance.strategies.shapes import MODEL_SHAPES, LayerShape, capped, dtypes, layer_shapes

__all__ = [
    "ADAPTER_MODES",
    "DENSE_LAYOUTS",
    "ENABLED_MODES",
    "FORWARD_KINDS",
    "MODEL_SHAPES",
    "MODULE_LAYOUTS",
    "ROUTING_MODES",
    "SENTINEL_SHARES",
    "SIZE_CLASSES",
    "AlignProblem",
    "BatchPlan",
    "LayerShape",
    "MaterializedCase",
    "MoELayer",
    "MoELoRACase",
    "RoutingPlan",
    "SlotAdapter",
    "adapter_pools",
    "align_problems",
    "batch_plans",
    "batch_specs",
    "capped",
    "dtypes",
    "layer_shapes",
    "moe_lora_cases",
    "pool_ranks",
    "pool_scalings",
    "routing_plans",
    "sigmas",
    "slot_adapters",
]
