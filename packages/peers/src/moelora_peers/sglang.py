"""SGLang 0.5.23's MoE-LoRA paths as moelora backends (``--backend moelora_peers.sglang:<path>``).

- ``legacy``: the fused shrink/expand as SGLang's default csgmv LoRA backend runs it
  (:mod:`moelora_peers.sglang_hooks`);
- ``virtual_experts``: ``merged_experts_fused_moe_lora_add``, as ``--lora-use-virtual-experts`` runs it;
- ``grouped``: the plan-based runner's stages (:mod:`moelora_peers.sglang_grouped`).

Dense deltas of every path: SGLang's csgmv kernels (:mod:`moelora_peers.sglang_dense`).
"""

from __future__ import annotations

from functools import partial

from moelora_core.layer_spec import LoRALayerSpec
from moelora_peers.peer_backend import PeerBackend


def legacy(spec: LoRALayerSpec) -> PeerBackend:
    """``moelora_peers.sglang:legacy``: SGLang's ``fused_moe_lora`` with its per-slot alignment."""
    from moelora_peers.sglang_hooks import make_path

    return PeerBackend(spec, partial(make_path, virtual=False))


def virtual_experts(spec: LoRALayerSpec) -> PeerBackend:
    """``moelora_peers.sglang:virtual_experts``: SGLang's ``merged_experts_fused_moe_lora_add``."""
    from moelora_peers.sglang_hooks import make_path

    return PeerBackend(spec, partial(make_path, virtual=True))


def grouped(spec: LoRALayerSpec) -> PeerBackend:
    """``moelora_peers.sglang:grouped``: the plan-based runner's stages (``resolve_plans`` for the device)."""
    from moelora_peers.sglang_grouped import make_path

    return PeerBackend(spec, make_path)
