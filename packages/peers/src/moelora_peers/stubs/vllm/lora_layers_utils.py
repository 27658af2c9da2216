"""Stands in for ``vllm.lora.layers.utils`` (imports vLLM's base fused-MoE module, which loads the
compiled ``vllm._C`` ops at import).

Provides: ``LoRAMapping`` / ``LoRAMappingType`` (those of ``moelora_peers.stubs.vllm.lora_layers``)
and ``try_get_optimal_moe_lora_config``, which raises: the adapter calls the punica wrapper with
``use_tuned_config=True`` (vLLM's path when ``VLLM_TUNED_CONFIG_FOLDER`` is set), where the configs
come from ``get_lora_op_configs`` (``vllm/lora/ops/triton_ops/utils.py``, vLLM's own file) and
this function is imported but never called.
"""

from moelora_peers.stubs.vllm.lora_layers import LoRAMapping, LoRAMappingType  # noqa: F401


def try_get_optimal_moe_lora_config(*_args, **_kwargs):
    raise NotImplementedError("moelora_peers: vLLM's base-MoE config lookup is not imported (it loads vllm._C); "
                              "the punica wrapper is called with use_tuned_config=True")
