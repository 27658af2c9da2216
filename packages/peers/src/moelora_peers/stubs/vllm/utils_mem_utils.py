"""Stands in for ``vllm.utils.mem_utils`` (memory profiling; imports psutil and vLLM's compiled ops).

Provides: ``get_max_shared_memory_bytes(gpu)``: the device's opt-in shared memory per block
(``torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin``; vLLM asks its compiled
``_custom_ops`` for the same attribute); 0 without CUDA, where vLLM only consults it on
``is_cuda_alike()`` platforms.
"""

from __future__ import annotations

import torch

from moelora_peers.stubs._platform import is_cuda


def get_max_shared_memory_bytes(gpu: int = 0) -> int:
    if not is_cuda():
        return 0
    return int(torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin)
