"""Stands in for the ``vllm.platforms`` package (``current_platform``: the platform plugin registry).

vLLM resolves ``current_platform`` by probing plugins and NVML/ROCm libraries; without a GPU driver
it becomes an "unspecified" platform whose kernels are placeholders. Provides ``current_platform``,
answering for the real device: ``is_cuda`` / ``is_cuda_alike`` (a CUDA device is present),
``is_rocm`` / ``is_xpu`` (False), ``is_cpu`` (no CUDA device), ``has_device_capability(90)`` (at least) /
``is_device_capability((9, 0))`` (exactly; a tuple or ``major*10+minor``) / ``get_device_capability()``
(the device's compute capability; None / False on a CPU),
``num_compute_units(index)`` (the SM count; 1 on a CPU: a tiling heuristic's input only),
``dispatch_key`` (where vLLM's ``direct_register_custom_op`` registers its ops: ``_platform.dispatch_key``),
``device_type`` / ``device_name``, ``is_pin_memory_available()``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moelora_peers.stubs._platform import cuda_capability, dispatch_key, is_cuda

IS_PACKAGE = True


class _Platform:
    @property
    def dispatch_key(self) -> str:
        return dispatch_key()

    @property
    def device_type(self) -> str:
        return "cuda" if is_cuda() else "cpu"

    device_name = device_type

    def is_cuda(self) -> bool:
        return is_cuda()

    def is_cuda_alike(self) -> bool:
        return is_cuda()

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not is_cuda()

    def is_out_of_tree(self) -> bool:
        return False

    def is_confidential_compute(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        cap = cuda_capability()
        return None if cap is None else SimpleNamespace(major=cap[0], minor=cap[1],
                                                        to_int=lambda: cap[0] * 10 + cap[1])

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = cuda_capability()
        if cap is None:
            return False
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return cap[0] * 10 + cap[1] >= want

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        # vLLM's meaning (vllm/platforms/interface.py): exactly this capability, a (major, minor)
        # tuple or major*10+minor; False without CUDA. lora_expand_op.py asks it on CUDA for sm90.
        cap = cuda_capability()
        if cap is None:
            return False
        if isinstance(capability, tuple):
            return tuple(cap) == tuple(capability)
        return cap[0] * 10 + cap[1] == capability

    def num_compute_units(self, device_id: int | None = 0) -> int:
        if not is_cuda():
            return 1
        return torch.cuda.get_device_properties(device_id or 0).multi_processor_count

    def is_pin_memory_available(self) -> bool:
        return is_cuda()

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if is_cuda() else "cpu"


current_platform = _Platform()
