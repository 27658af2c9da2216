"""The ``csgmv`` backend: dense LoRA by chunked SGMV over adapter-sorted tokens; MoE-LoRA per request.

Tokens are stably sorted by adapter slot (``NO_ADAPTER`` first, batch order within a slot) and each
slot's run is cut into chunks of ``chunk_size`` tokens (:func:`~.segmentation.chunk_segments`), with
the permutation; the chunked SGMV kernels read tokens through it and keep the rank-wide
intermediate by sorted position, so each program streams one slot's A and B over a contiguous
chunk (SGLang's ``chunked_backend.py``, sgl-project/sglang#10286).

Chunk size: from the token count (:func:`~.segmentation.chunk_size_for`) — the batch's eagerly,
the family's token capacity in graph mode, fixed at capture with the capacities ``num_tokens //
chunk_size + min(max_loras + 1, max_requests)`` chunks and ``max_len = chunk_size``.

Chunks are not requests: the MoE path reads the per-request fields (``moe.seg_indptr``,
``moe.req_to_lora``) and the token mapping made from them, never the chunks (the fault fixed by
sgl-project/sglang#24007). Build with :func:`make_backend` (the built-in name ``csgmv``).
"""

from __future__ import annotations

from functools import partial

from moelora_backends.kernel_backend import KernelBackend
from moelora_backends.segmentation import Segmentation, chunk_segments, chunk_size_for, max_chunk_segments
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

    def family_layout(self, family: str, max_requests: int, max_tokens: int, tokens_per_request: int | None):
        L = self.spec.max_loras
        size = chunk_size_for(max_tokens)
        cap = LaunchSizes(max_requests, max_tokens, L, max_chunk_segments(max_tokens, max_requests, L, size),
                       min(size, max_tokens), True)
        return cap, partial(self.chunk_segments, chunk_size=size)


def make_backend(spec: LoRALayerSpec) -> CsgmvBackend:
    """The factory of the built-in ``csgmv`` backend (``moelora_backends.csgmv_backend:make_backend``)."""
    return CsgmvBackend(spec)
