"""SGLang 0.5.23's MoE-LoRA modules, imported from the released files through the stubs.

:func:`modules` puts the SGLang finder on ``sys.meta_path`` (:mod:`moelora_peers.loader`) and imports
the kernel modules and call sites the three SGLang paths run, unchanged:

- ``sglang.srt.lora.lora_moe_runners`` (``_add_lora_gate_up_delta``, ``_add_lora_down_delta``,
  ``_compute_lora_alignment``, ``_naive_moe_lora_align_block_size``, ``LoRAInfo``) and what it calls:
  ``sglang.kernels.ops.lora.moe.fused_moe_lora_kernel`` (legacy), ``...virtual_experts``;
- the plan-based path: ``sglang.srt.lora.moe.{plan,routing,runner}``,
  ``sglang.kernels.ops.lora.common.{routing,lora_a,lora_b}``, ``sglang.kernels.ops.lora.moe.lora_b``;
- the dense csgmv kernels ``sglang.kernels.ops.lora.dense.chunked_sgmv_{shrink,expand}``.

:data:`STUBS` maps each server module those files import at their top to its stand-in; every other
module they import is SGLang's own file (``PeerImporter.loaded`` lists them). ``sglang/__init__.py``
never runs. conformance/docs/peers.md lists the stubs and the files.
"""

from __future__ import annotations

import functools
import importlib.util
import types

from moelora_peers.loader import PeerImporter, import_peer, install
from moelora_peers.stubs._platform import is_cuda

_S = "moelora_peers.stubs.sglang."

#: SGLang server module → the stub that replaces it (conformance/docs/peers.md, "SGLang stubs").
STUBS: dict[str, str] = {
    "sglang.srt.utils": _S + "srt_utils",
    "sglang.srt.utils.common": _S + "srt_utils_common",
    "sglang.srt.utils.hf_transformers_utils": _S + "srt_utils_hf_transformers_utils",
    "sglang.srt.distributed": _S + "srt_distributed",
    "sglang.srt.model_executor.runner": _S + "srt_model_executor_runner",
    "sglang.srt.model_executor.forward_batch_info": _S + "srt_model_executor_forward_batch_info",
    "sglang.srt.layers.moe.utils": _S + "srt_layers_moe_utils",
    "sglang.srt.batch_invariant_ops": _S + "srt_batch_invariant_ops",
    "sglang.srt.layers.moe.moe_runner.triton_utils": _S + "srt_layers_moe_moe_runner_triton_utils",
}

#: Without SGLang's native align (no CUDA, or no ``sgl_kernel``): peer module → its substitute
#: (``moelora_peers.substitutes``).
CPU_SUBSTITUTES: dict[str, str] = {
    "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size":
        "moelora_peers.substitutes.sglang_moe_align_block_size",
}

#: Packages whose own ``__init__.py`` runs (small: they re-export what the kernel files import);
#: every other SGLang package is a shell (``sglang/__init__.py`` included).
#: ``sglang.kernels.ops.quantization``: its init defines ``sgl_per_token_quant_fp8`` (a kernel-registry
#: wrapper of a JIT kernel), which ``quantization/fp8_kernel.py`` imports from the package on CUDA only
#: (the base MoE kernel of the virtual-experts expand imports ``fp8_kernel``;
#: ``test_every_module_imports_as_on_cuda``).
RUN_INIT: tuple[str, ...] = (
    "sglang.kernels.jit.utils",
    "sglang.kernels.jit.utils.compile",
    "sglang.kernels.ops.quantization",
    "sglang.srt.lora.moe.base_gemm_provider",
)

#: The modules the adapters use, by short name.
MODULES: dict[str, str] = {
    "runners": "sglang.srt.lora.lora_moe_runners",
    "fused": "sglang.kernels.ops.lora.moe.fused_moe_lora_kernel",
    "virtual": "sglang.kernels.ops.lora.moe.virtual_experts",
    "moe_align": "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size",
    "plan": "sglang.srt.lora.moe.plan",
    "routing": "sglang.srt.lora.moe.routing",
    "runner": "sglang.srt.lora.moe.runner",
    "workspace": "sglang.srt.lora.workspace",
    "lora_utils": "sglang.srt.lora.utils",
    "csgmv_shrink": "sglang.kernels.ops.lora.dense.chunked_sgmv_shrink",
    "csgmv_expand": "sglang.kernels.ops.lora.dense.chunked_sgmv_expand",
    "capture": "sglang.srt.model_executor.runner",
}

#: Modules the paths import inside a call (not among :data:`MODULES`) or only on CUDA (behind an
#: ``if _is_cuda:`` false on a CPU): ``moelora_peers.collect`` imports them too, so the GPU folder
#: carries their files and ``test_every_module_imports_as_on_cuda`` imports them as on a GPU. The
#: virtual-experts expand runs the base MoE kernel, whose ``quantization/fp8_kernel.py`` imports the
#: JIT quantization modules on CUDA.
LAZY_MODULES: tuple[str, ...] = (
    "sglang.kernels.ops.moe.fused_moe_triton_kernels",
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",
    "sglang.kernels.ops.quantization.per_tensor_quant_fp8",
    "sglang.kernels.ops.quantization.per_token_group_quant",
    "sglang.kernels.ops.quantization.per_token_quant_fp8",
)


def native_moe_align_available() -> bool:
    """Whether SGLang's native ``moe_align_block_size`` can run: a CUDA device and ``sgl_kernel`` (the
    compiled kernel wheel). Otherwise :data:`CPU_SUBSTITUTES` apply (on a GPU without sgl_kernel too)."""
    return is_cuda() and importlib.util.find_spec("sgl_kernel") is not None


@functools.cache
def importer() -> PeerImporter:
    """The SGLang finder (installed once per process)."""
    stubs = dict(STUBS) if native_moe_align_available() else {**STUBS, **CPU_SUBSTITUTES}
    return install("sglang", stubs, RUN_INIT)


def module(short: str) -> types.ModuleType:
    """One of :data:`MODULES` by its short name, imported through :func:`importer`."""
    return import_peer(importer(), MODULES[short])
