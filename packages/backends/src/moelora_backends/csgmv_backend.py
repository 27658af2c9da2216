"""The ``csgmv`` backend: dense LoRA by chunked SGMV over adapter-sorted tokens; MoE-LoRA per request.

Tokens are stably sorted by adapter slot (``NO_ADAPTER`` first, batch order within a slot) and each
slot's run is cut into chunks of ``chunk_size`` tokens (:func:`~.segmentation.chunk_segments`), with
the permutation; the chunked SGMV kernels read tokens through it and keep the rank-wide
intermediate by sorted position, so each program streams one slot's A and B over a contiguous
chunk (SGLang's ``chunked_backend.py``, sgl-project/sglang#10286).

Chunk size: from the token count (:func:`~.segmentation.chunk_size_for`) — the batch's eagerly, the
graph family's token capacity (its largest bucket) in graph mode, the same for every bucket of the
family, so a bucket's ``num_tokens // chunk_size + min(max_loras + 1, max_requests)`` chunks never
exceed the family's buffers; ``max_len = min(chunk_size, the bucket's tokens)``, fixed at capture.

Chunks are not requests: the MoE path reads the token map, made from the request segments
(``req_seg_indptr``, ``req_weight_indices``), never the chunks (the fault fixed by
sgl-project/sglang#24007). Build with :func:`make_backend` (the built-in name ``csgmv``).
"""

from __future__ import annotations

from functools import partial

from moelora_backends.kernel_backend import KernelBackend
from moelora_backends.segmentation import Segmentation, chunk_segments, chunk_size_for, max_chunk_segments
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import LaunchSizes


class CsgmvBackend(KernelBackend):
    """Chunked SGMV over adapter-sorted chunks; MoE-LoRA on the per-request fields."""

    name = "csgmv"
    chunked = True
    #: The segmentation (a host function of a ``BatchSpec`` and a chunk size).
    chunk_segments = staticmethod(chunk_segments)

    def eager_segmentation(self, batch: BatchSpec) -> Segmentation:
        return self.chunk_segments(batch, chunk_size_for(batch.num_tokens))

    def family_layout(self, family: str, capacity: GraphCapacity, family_capacity: GraphCapacity):
        L = self.spec.max_loras
        requests, tokens = capacity.max_requests, capacity.max_tokens
        size = chunk_size_for(family_capacity.max_tokens)  # the family's: bucket chunk counts stay within its buffers
        sizes = LaunchSizes(requests, tokens, L, max_chunk_segments(tokens, requests, L, size), min(size, tokens), True)
        return sizes, partial(self.chunk_segments, chunk_size=size)


def make_backend(spec: LoRALayerSpec) -> CsgmvBackend:
    """The factory of the built-in ``csgmv`` backend (``moelora_backends.csgmv_backend:make_backend``)."""
    return CsgmvBackend(spec)
