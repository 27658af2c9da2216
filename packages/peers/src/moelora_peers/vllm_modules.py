"""vLLM's MoE-LoRA modules (``vllm/lora/ops/triton_ops/fused_moe_lora_op.py`` and the punica
wrapper's call sites), imported from the released files through the stubs; ``vllm/__init__.py``
never runs. :data:`STUBS` maps each replaced server module to its stand-in (conformance/docs/peers.md,
"vLLM stubs").
"""

from __future__ import annotations

import functools
import types

from moelora_peers.loader import PeerImporter, import_peer, install

_S = "moelora_peers.stubs.vllm."

#: vLLM server module → the stub that replaces it.
STUBS: dict[str, str] = {
    "vllm.platforms": _S + "platforms",
    "vllm.distributed": _S + "distributed",
    "vllm.triton_utils": _S + "triton_utils",
    "vllm.utils.mem_utils": _S + "utils_mem_utils",
    "vllm.logger": _S + "logger",
    "vllm._custom_ops": _S + "custom_ops",
    "vllm.lora.layers": _S + "lora_layers",
    "vllm.lora.layers.utils": _S + "lora_layers_utils",
    "vllm.lora.utils": _S + "lora_utils",
    "vllm.model_executor.layers.fused_moe.config": _S + "model_executor_layers_fused_moe_config",
}

#: Packages whose own ``__init__.py`` runs; every other vLLM package is a shell.
RUN_INIT: tuple[str, ...] = ("vllm.lora.ops.triton_ops",)

MODULES: dict[str, str] = {
    "fused": "vllm.lora.ops.triton_ops.fused_moe_lora_op",
    "utils": "vllm.lora.ops.triton_ops.utils",
    "punica_gpu": "vllm.lora.punica_wrapper.punica_gpu",
    "lora_layers": "vllm.lora.layers",
}

#: Modules the path imports inside a call or only on CUDA (``sglang_modules.LAZY_MODULES``): none.
LAZY_MODULES: tuple[str, ...] = ()


@functools.cache
def importer() -> PeerImporter:
    """The vLLM finder (installed once per process)."""
    return install("vllm", STUBS, RUN_INIT)


def module(short: str) -> types.ModuleType:
    """One of :data:`MODULES` by its short name, imported through :func:`importer`."""
    return import_peer(importer(), MODULES[short])
