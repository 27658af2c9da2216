"""The layer harness of the conformance suite (DESIGN.md §5, §6).

- :mod:`.inputs`: per-batch values (``BatchInputs``), reordering, derived batches, pad rows;
- :mod:`.layer`: ``Layer`` — one backend on one case's weights, eager forwards
  (projection — contiguous or fused q|k|v outputs — → break op → one or two MoE layers on the
  ``deltas`` or ``fused`` path), adapter reloads;
- :mod:`.graph`: ``GraphLayer`` — the decode, prefill-full and prefill-breakable graph modes;
- :mod:`.break_op`: the attention-like op between the two;
- :mod:`.expected`: the oracle values of a run and the standard checks;
- :mod:`.checks`: comparisons (policy, LoRA delta, bitwise).
"""

from moelora_conformance.harness.checks import CheckContext, assert_bitwise, assert_close, assert_delta_close
from moelora_conformance.harness.expected import Oracle, check_run
from moelora_conformance.harness.graph import GRAPH_MODES, GraphLayer
from moelora_conformance.harness.inputs import BatchInputs, derive_inputs
from moelora_conformance.harness.layer import GUARD_VALUE, MOE_PATHS, Layer, LayerOutput, MoEOutput, all_base

__all__ = [
    "GRAPH_MODES",
    "GUARD_VALUE",
    "MOE_PATHS",
    "BatchInputs",
    "CheckContext",
    "GraphLayer",
    "Layer",
    "LayerOutput",
    "MoEOutput",
    "Oracle",
    "all_base",
    "assert_bitwise",
    "assert_close",
    "assert_delta_close",
    "check_run",
    "derive_inputs",
]
