"""The platform facts every stub answers from: the real device, asked once."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of CUDA device 0, or None without a CUDA device."""
    if not (torch.cuda.is_available() and torch.version.cuda is not None):
        return None
    return torch.cuda.get_device_capability(0)


def is_cuda() -> bool:
    return cuda_capability() is not None


def dispatch_key() -> str:
    """The dispatch key the peers' custom ops are registered under on this machine: "CUDA" on a GPU
    (the peers' own); on a CPU "CompositeImplicitAutograd", so the op's Python implementation runs
    in the caller's torch modes and moelora's graph emulator records what it launches — the Triton
    kernels a CUDA graph captures — and sees its host reads of host tensors (vLLM's
    ``no_lora_flag_cpu``) as the host reads they are on CUDA, where "CPU" would hide the op's body
    behind one opaque aten-level call that reads a host tensor (conformance/docs/peers.md, E1)."""
    return "CUDA" if is_cuda() else "CompositeImplicitAutograd"
