"""Custom-op registration as SGLang's ``direct_register_custom_op`` and vLLM's do it, for this device.

Both peers define the op's schema from the Python signature (``torch.library.infer_schema``) in
their own library fragment ("sglang", "vllm") and register the implementation under the platform's
dispatch key. The peers register "CUDA" (SGLang: CUDA / HIP / XPU / MUSA / PrivateUse1, never CPU);
here the key is :func:`moelora_peers.stubs._platform.dispatch_key` ("CUDA" on a GPU; on a CPU
"CompositeImplicitAutograd", so the op's body runs in the caller's torch modes and moelora's graph
emulator records what it launches), and the peers' ``torch.ops.<lib>.<op>`` call sites run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.library

from moelora_peers.stubs._platform import dispatch_key

_LIBRARIES: dict[str, torch.library.Library] = {}


def register(lib_name: str, op_name: str, op_func: Callable, mutates_args: list[str],
             fake_impl: Callable | None = None) -> None:
    """Define ``torch.ops.<lib_name>.<op_name>`` from ``op_func``'s signature (once per process)."""
    lib = _LIBRARIES.get(lib_name)
    if lib is None:
        lib = _LIBRARIES[lib_name] = torch.library.Library(lib_name, "FRAGMENT")
    if hasattr(getattr(torch.ops, lib_name), op_name):
        return  # already registered in this process (the peers skip the same way)
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args)
    lib.define(op_name + schema)
    key = dispatch_key()
    lib.impl(op_name, op_func, key)
    # A CompositeImplicitAutograd op decomposes (its fake is its body's), and torch refuses a fake
    # kernel beside it; the peers' fakes serve torch.compile only, which the suite does not run.
    if fake_impl is not None and key != "CompositeImplicitAutograd":
        lib._register_fake(op_name, fake_impl)
