"""Stands in for the ``vllm.distributed`` package (process groups, TP collectives).

Provides: ``tensor_model_parallel_all_gather`` / ``tensor_model_parallel_all_reduce`` (imported by
``fused_moe_lora_op``; called only with ``fully_sharded=True``, which the layer suite never passes:
they raise) and ``get_tensor_model_parallel_world_size`` / ``_rank`` (1 / 0).
"""

from __future__ import annotations

IS_PACKAGE = True


def _no_tp(*_args, **_kwargs):
    raise NotImplementedError("moelora_peers: tensor-parallel collectives are not part of the layer suite "
                              "(the peer's fully_sharded path is not run)")


tensor_model_parallel_all_gather = _no_tp
tensor_model_parallel_all_reduce = _no_tp


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0
