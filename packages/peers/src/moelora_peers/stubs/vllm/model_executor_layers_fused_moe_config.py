"""Stands in for ``vllm.model_executor.layers.fused_moe.config`` (the fused-MoE quantization
configs: imports vLLM's engine config, distributed groups and quantization utilities).

Provides: ``_get_config_dtype_str(dtype, use_fp8_w8a8=False, ...)``, the one name the punica
wrapper's MoE call sites import (the tuning-file dtype tag): vLLM's answers for the unquantized
case ("float32" for fp32, None otherwise); a quantized flag raises (not part of the layer suite).
"""

import torch


def _get_config_dtype_str(dtype, use_fp8_w8a8=False, use_fp8_w8a16=False, use_int8_w8a16=False,
                          use_int4_w4a16=False, ocp_mx_scheme=None):
    if use_fp8_w8a8 or use_fp8_w8a16 or use_int8_w8a16 or use_int4_w4a16 or ocp_mx_scheme is not None:
        raise NotImplementedError("moelora_peers: quantized MoE LoRA is not part of the layer suite")
    return "float32" if dtype == torch.float else None
