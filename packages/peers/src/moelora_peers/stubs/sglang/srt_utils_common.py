"""Stands in for ``sglang.srt.utils.common`` (5,000 lines: server, network, multimodal helpers).

Provides: the platform checks ``is_cuda``, ``is_hip``, ``is_xpu``, ``is_npu``, ``is_musa``,
``is_sm90_supported``, ``is_sm100_supported``, ``is_blackwell_supported``, ``get_device_sm`` (answered
for the real device); ``is_cpu`` and ``cpu_has_amx_support`` (False: they select SGLang's separate
AMX CPU engine, ``SGLANG_USE_CPU_ENGINE=1``, which is not the path under test); ``get_device_name``
(the CUDA device's name; ``"cpu"`` without CUDA, where the real one returns None and the tuned-config
lookup cannot format it: no tuned table matches a CPU, the default config applies);
``next_power_of_2``, ``ceil_div``, ``ceil_align``, ``torch_release`` (SGLang's definitions);
``log_info_on_rank0`` (logs: one rank); ``cached_triton_kernel`` (returns the kernel unchanged:
Triton's own launch cache, as SGLang runs with ``SGLANG_USE_CUSTOM_TRITON_KERNEL_CACHE=0``; its
``CachedKernel`` cuts launch overhead only and cannot run under the interpreter); ``direct_register_custom_op``
(``moelora_peers.stubs._custom_op``: the op under this device's dispatch key). Makes unnecessary: orjson, psutil,
pybase64, requests, pillow, starlette (imported at the real module's top for server code only).
"""

from __future__ import annotations

import torch

from moelora_peers.stubs import _custom_op
from moelora_peers.stubs._platform import cuda_capability
from moelora_peers.stubs._platform import is_cuda as _is_cuda


def is_cuda() -> bool:
    return _is_cuda()


def is_hip() -> bool:
    return torch.version.hip is not None


def is_xpu() -> bool:
    return False


def is_npu() -> bool:
    return False


def is_musa() -> bool:
    return False


def get_device_sm() -> int:
    cap = cuda_capability()
    return 0 if cap is None else cap[0] * 10 + cap[1]


def is_sm90_supported(device=None) -> bool:
    cap = cuda_capability()
    return cap is not None and cap[0] >= 9 and torch.version.cuda is not None


def is_sm100_supported(device=None) -> bool:
    cap = cuda_capability()
    return cap is not None and cap[0] == 10


def is_blackwell_supported(device=None) -> bool:
    cap = cuda_capability()
    return cap is not None and cap[0] in (10, 12)


def is_cpu() -> bool:
    return False


def cpu_has_amx_support() -> bool:
    return False


def get_device_name(device_id: int = 0) -> str:
    return torch.cuda.get_device_name(device_id) if _is_cuda() else "cpu"


torch_release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3] if p.isdigit())


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def ceil_align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def log_info_on_rank0(logger, msg: str) -> None:
    logger.info(msg)


def cached_triton_kernel(key_fn=None):
    return lambda fn: fn


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


def direct_register_custom_op(op_name, op_func, mutates_args, fake_impl=None, target_lib=None) -> None:
    _custom_op.register("sglang", op_name, op_func, mutates_args, fake_impl)
