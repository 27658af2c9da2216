"""moelora_kernels: Triton kernels and their launchers for MoE multi-LoRA serving (DESIGN.md §4).

Every launcher checks its preconditions on the host (raising
:class:`moelora_core.KernelPreconditionError`), sizes its grid from capacities and host numbers,
and never reads a device value, so all of them are safe inside CUDA-graph capture. Each kernel has
a readable twin in ``moelora_reference`` (see the package README for the map).

- alignment and mapping: :func:`moe_lora_align_block_size`, :func:`moe_align_block_size`,
  :func:`token_lora_mapping`                                                  (:mod:`.align`, :mod:`.mapping`)
- base fused MoE: :func:`fused_moe_gemm`, :func:`moe_activation`, :func:`moe_sum`, :func:`fused_moe`
                                                  (:mod:`.fused_moe`, :mod:`.moe_epilogue`, :mod:`.moe_forward`)
- MoE-LoRA: :func:`fused_moe_lora_shrink`, :func:`fused_moe_lora_expand`, :func:`fused_moe_lora`,
  :func:`moe_lora_delta`                                                       (:mod:`.moe_lora`)
- virtual experts: :func:`virtual_topk_ids`, :func:`virtual_align`, :func:`virtual_moe_lora_delta`
                                                                               (:mod:`.virtual_experts`)
- dense LoRA: :func:`segmented_lora_a`, :func:`segmented_lora_b`, :func:`chunked_sgmv_shrink`,
  :func:`chunked_sgmv_expand`, :func:`dense_lora_delta`                        (:mod:`.sgmv`)
- block configs: :func:`kernel_config`, :func:`moe_block_m`                   (:mod:`.configs`)
"""

from moelora_kernels.align import moe_align_block_size, moe_lora_align_block_size
from moelora_kernels.configs import kernel_config, moe_block_m
from moelora_kernels.fused_moe import fused_moe_gemm, used_blocks_bound
from moelora_kernels.mapping import token_lora_mapping
from moelora_kernels.moe_epilogue import moe_activation, moe_sum
from moelora_kernels.moe_forward import MoELoRAInputs, fused_moe
from moelora_kernels.moe_lora import (
    STAGES,
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_lora_delta,
    stage_tensors,
)
from moelora_kernels.sgmv import (
    chunked_sgmv_expand,
    chunked_sgmv_shrink,
    dense_lora_delta,
    segmented_lora_a,
    segmented_lora_b,
)
from moelora_kernels.virtual_experts import (
    virtual_align,
    virtual_moe_lora_delta,
    virtual_topk_ids,
)

__version__ = "0.1.0"

__all__ = [
    "STAGES",
    "MoELoRAInputs",
    "chunked_sgmv_expand",
    "chunked_sgmv_shrink",
    "dense_lora_delta",
    "fused_moe",
    "fused_moe_gemm",
    "fused_moe_lora",
    "fused_moe_lora_expand",
    "fused_moe_lora_shrink",
    "kernel_config",
    "moe_activation",
    "moe_align_block_size",
    "moe_block_m",
    "moe_lora_align_block_size",
    "moe_lora_delta",
    "moe_sum",
    "segmented_lora_a",
    "segmented_lora_b",
    "stage_tensors",
    "token_lora_mapping",
    "used_blocks_bound",
    "virtual_align",
    "virtual_moe_lora_delta",
    "virtual_topk_ids",
]
