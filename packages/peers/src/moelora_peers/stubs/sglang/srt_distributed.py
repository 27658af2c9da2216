"""Stands in for the ``sglang.srt.distributed`` package (NCCL groups, TP collectives).

Provides: ``tensor_model_parallel_all_gather`` / ``tensor_model_parallel_all_reduce`` (imported by
``fused_moe_lora_kernel``; called only with ``fully_sharded=True``, which the layer suite never
passes: they raise) and ``get_tensor_model_parallel_world_size`` / ``_rank`` (1 / 0: one rank).
"""

from moelora_peers.stubs._tp import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, no_tp

IS_PACKAGE = True
tensor_model_parallel_all_gather = tensor_model_parallel_all_reduce = no_tp
__all__ = ["get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
           "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce"]
