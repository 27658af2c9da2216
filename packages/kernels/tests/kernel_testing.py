"""Helpers of the kernel tests (not tests themselves).

- ``DEVICE``: CUDA where present, else the CPU (kernels then run under TRITON_INTERPRET=1).
- :func:`launch_guard`: every kernel launch in the tests runs inside it; on CUDA it turns
  ``torch.cuda.set_sync_debug_mode("error")`` on, so a launcher that syncs fails the test (inputs
  are built before, results read after).
- NaN poisoning, bitwise row checks, CPU copies for the readable twins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moelora_core import DEFAULT_POLICY
from moelora_core.align import AlignOutput

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"


@contextlib.contextmanager
def launch_guard() -> Iterator[None]:
    """Fail on any host↔device sync inside (CUDA); a no-op on the CPU."""
    if not ON_GPU:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def poisoned(*shape: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """A NaN-filled float tensor: an element a kernel should write and does not stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def poisoned_align(max_loras: int, rows: int, block_m: int, device: torch.device = DEVICE) -> AlignOutput:
    """Alignment buffers full of values no correct kernel writes (stale garbage of a previous batch)."""
    return AlignOutput(
        torch.full((max_loras, rows), 0x3FFF_FFFF, dtype=torch.int32, device=device),
        torch.full((max_loras, rows // block_m), 0x3FFF_FFFF, dtype=torch.int32, device=device),
        torch.full((max_loras,), 0x3FFF_FFFF, dtype=torch.int32, device=device),
    )


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0,
          device: torch.device = DEVICE) -> torch.Tensor:
    """Fresh N(0, scale²) values from the test's generator (never zeros)."""
    return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(device=device, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (NaN == NaN, -0.0 != +0.0), on the CPU."""
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype]
    return t.detach().cpu().contiguous().view(view)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str, seed: int | None = None) -> None:
    """Every bit equal (for rows a kernel must leave untouched, and early exits)."""
    a, e = bits(actual), bits(expected)
    diff = a != e
    n = int(diff.sum())
    if n:
        first = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {n} of {a.numel()} elements changed bits (seed={seed}); first at {first}: "
                             f"expected {[expected.cpu()[tuple(i)].item() for i in first]}, "
                             f"actual {[actual.cpu()[tuple(i)].item() for i in first]}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, what: str,
                 seed: int | None = None) -> None:
    """The tolerance policy's norm-based check for ``dtype`` on the test device."""
    DEFAULT_POLICY.assert_close(actual, expected, dtype=dtype, device=DEVICE, what=what, seed=seed)


def cpu(value):
    """A CPU copy of a tensor / AlignOutput / None (the readable twins run on the CPU)."""
    if value is None:
        return None
    if isinstance(value, AlignOutput):
        return AlignOutput(*(t.cpu() for t in value))
    return value.detach().cpu()


def rows_mask(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Bool [num_rows] with True at ``rows``."""
    mask = torch.zeros(num_rows, dtype=torch.bool)
    mask[rows.cpu().long()] = True
    return mask
