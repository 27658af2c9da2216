"""The ``triton`` backend: dense LoRA over per-request segments (EXTEND), adapter-sorted segments
with a permutation (DECODE), 16-token tiles in the prefill graph; MoE-LoRA per request.

Segmentations (:mod:`.segmentation`), as SGLang's Triton LoRA backend (``triton_backend.py``):

- eager EXTEND: one segment per request, ``max_len`` = the longest request;
- eager DECODE and the decode graph: requests stably sorted by adapter, one segment per adapter
  (``NO_ADAPTER`` included) with the token permutation; graph capacities: ``min(max_bs,
  max_loras + 1)`` segments, ``max_len = max_bs · tokens_per_request`` (one adapter may hold the
  whole batch);
- the prefill graph: runs of adjacent requests on the same adapter cut into tiles of 16 tokens, no
  permutation; capacities ``max_num_tokens // 16 + max_num_requests`` segments (the grid bound of
  DESIGN.md §5) and ``max_len = 16``. Whatever the request lengths, the launch shape is fixed at
  capture and its work is bounded by the live tiles.

The dense kernels keep the rank-wide intermediate by token row (segmented LoRA-A/B). Build with
:func:`make_backend` (the built-in name ``triton``).
"""

from __future__ import annotations

from functools import partial

from moelora_backends.kernel_backend import KernelBackend
from moelora_backends.segmentation import (
    PREFILL_TILE,
    Segmentation,
    adapter_segments,
    max_adapter_segments,
    max_tile_segments,
    request_segments,
    tile_segments,
)
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.forward_mode import ForwardMode
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import LaunchSizes


class TritonBackend(KernelBackend):
    """Segmented LoRA-A/B over requests, adapters or tiles; MoE-LoRA on the per-request fields."""

    name = "triton"
    chunked = False
    #: Its MoE deltas read the activations they are given, whatever base the caller ran (the engine's
    #: w8a8 Triton base hands them the unquantized x and h): fp8 block-scaled bases are served.
    base_quants = frozenset({"none", "fp8_block"})
    #: The segmentation of each situation (host functions of a ``BatchSpec``).
    extend_segments = staticmethod(request_segments)
    decode_segments = staticmethod(adapter_segments)
    prefill_graph_segments = staticmethod(tile_segments)

    def eager_segmentation(self, batch: BatchSpec) -> Segmentation:
        if batch.forward_mode is ForwardMode.DECODE:
            return self.decode_segments(batch)
        return self.extend_segments(batch)

    def family_layout(self, family: str, capacity: GraphCapacity, family_capacity: GraphCapacity):
        L = self.spec.max_loras
        requests, tokens = capacity.max_requests, capacity.max_tokens
        if family == "decode":
            sizes = LaunchSizes(requests, tokens, L, max_adapter_segments(requests, L), tokens, True)
            return sizes, self.decode_segments
        sizes = LaunchSizes(requests, tokens, L, max_tile_segments(tokens, requests, PREFILL_TILE),
                            min(PREFILL_TILE, tokens), False)
        return sizes, partial(self.prefill_graph_segments, tile=PREFILL_TILE)


def make_backend(spec: LoRALayerSpec) -> TritonBackend:
    """The factory of the built-in ``triton`` backend (``moelora_backends.triton_backend:make_backend``)."""
    return TritonBackend(spec)
