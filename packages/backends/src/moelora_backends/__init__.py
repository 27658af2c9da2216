"""moelora_backends: the ``triton`` and ``csgmv`` MoE multi-LoRA backends on ``moelora_kernels``
(DESIGN.md §5).

- :mod:`.triton_backend` (built-in name ``triton``): dense LoRA over per-request segments (EXTEND),
  adapter-sorted segments with a permutation (DECODE), 16-token tiles in the prefill graph;
- :mod:`.csgmv_backend` (``csgmv``): dense LoRA by chunked SGMV over adapter-sorted tokens;
- shared by both: :mod:`.kernel_backend` (the protocol on ``moelora_core.backend_base.BackendBase``,
  whose metadata machinery is ``moelora_core.metadata``), :mod:`.segmentation` (host-side
  segmentations and their capacities), :mod:`.deltas` (MoE-LoRA per request, dense over the
  segmentation, on the kernels).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
