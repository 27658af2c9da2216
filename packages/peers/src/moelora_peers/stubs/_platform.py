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
    """The dispatch key a custom op is registered under on this machine ("CUDA" or "CPU")."""
    return "CUDA" if is_cuda() else "CPU"
