"""Launcher helpers shared by every kernel file: precondition checks, dot precision, interpreter mode.

Every check here runs on the host from tensor metadata (shape, dtype, stride, device) only: none
reads a device value, so a launcher stays free of host syncs and is safe inside CUDA-graph capture.
A failed check raises :class:`moelora_core.KernelPreconditionError` naming the argument, before
anything is launched or written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import triton

from moelora_core.align import AlignOutput
from moelora_core.errors import KernelPreconditionError

if TYPE_CHECKING:
    from moelora_core.weights import LoRAWeights

#: Activation / weight dtypes the GEMM kernels compute in.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
#: Integer dtypes accepted for ids and offsets (loaded and narrowed after range checks).
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
#: Largest size of grid axes 1 and 2 on CUDA; launchers put the only unbounded axis (blocks of
#: rows) on axis 0, whose limit is 2**31 - 1.
MAX_GRID_AXIS = 65535
MAX_GRID_AXIS0 = 2**31 - 1


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype, tf32: bool = False) -> str:
    """The ``tl.dot`` ``input_precision`` for ``dtype``: IEEE for fp32 unless TF32 is asked for.

    Half dtypes ignore the value (their dots are exact products with fp32 accumulation).
    """
    if dtype == torch.float32 and not tf32:
        return "ieee"
    return "tf32"


def upcast_bf16(dtype: torch.dtype) -> bool:
    """Whether kernels must up-cast bf16 tiles to fp32 after loading: the Triton interpreter
    computes bf16 dots wrongly (numpy has no bf16), so under it every bf16 tile is widened before
    ``tl.dot``. On a GPU bf16 tiles go to the tensor cores as they are."""
    return dtype == torch.bfloat16 and interpreting()


def gemm_launch_options(dtype: torch.dtype, tf32: bool, cfg: dict[str, int]) -> dict[str, object]:
    """The launch keywords every GEMM kernel takes the same way: ``DOT_PRECISION`` and ``UPCAST`` for
    ``dtype`` (:func:`dot_precision`, :func:`upcast_bf16`), ``num_warps`` and ``num_stages`` of the
    block config ``cfg``."""
    return {"DOT_PRECISION": dot_precision(dtype, tf32), "UPCAST": upcast_bf16(dtype),
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


#: Values of the config key ``PDL`` (programmatic dependent launch), read by every kernel of the fused MoE
#: layer from its own op's table entry: the alignments (``moe_align_block_size``,
#: ``moe_lora_align_block_size``), the base GEMMs (``fused_moe_gemm``, and the fp8 GEMM, which takes its
#: entries), the fp8 activation quantization (``quantize_activation_fp8``), the activation and top-k sum
#: (``moe_epilogue``) and the MoE-LoRA kernels (``moe_lora_shrink``, ``moe_lora_expand``,
#: ``fused_moe_lora``): 0 = an ordinary launch; 1 = launched with PDL on sm_90 and newer, each program
#: waiting for the stream's previous grid before it reads or writes anything
#: (:func:`moelora_kernels._tiles.wait_for_producers`).
PDL: tuple[int, ...] = (0, 1)
#: The table ops whose entries may set ``PDL`` (above).
PDL_OPS: tuple[str, ...] = ("moe_align_block_size", "moe_lora_align_block_size", "fused_moe_gemm", "fp8_moe_gemm",
                            "quantize_activation_fp8", "moe_epilogue", "moe_lora_shrink", "moe_lora_expand",
                            "fused_moe_lora")


def pdl_options(cfg: dict, device: torch.device) -> dict[str, bool]:
    """The launch keywords of the config key ``PDL`` for a kernel that takes the constexpr ``PDL``:
    ``{"PDL": True, "launch_pdl": True}`` for ``PDL`` 1 on a CUDA device of compute capability 9.0 or
    newer, else ``{"PDL": False}`` (no ``launch_pdl`` keyword: the launch is the one before the key
    existed, on every backend Triton has, ROCm's included, whose options have no such field).

    With PDL (CUDA's programmatic dependent launch, kept as a programmatic edge when a CUDA graph
    captures it) the grid may start while the stream's previous grid is still finishing; its programs
    wait for that grid's completion and memory flush (``griddepcontrol.wait``) before any other
    instruction, so they read what it wrote, and every program waits, so a grid never completes before
    its predecessor (a third grid waiting on it waits on both). Under the interpreter, or with tensors
    on the CPU, programs run one after another and there is nothing to overlap: the value is checked
    and the launch is the ordinary one (same results; the twin has no PDL).

    Raises:
        KernelPreconditionError: ``PDL`` not one of :data:`PDL`; ``PDL`` 1 on a CUDA device below
            compute capability 9.0 (``griddepcontrol`` is Hopper's) or on a ROCm build, before anything is
            launched.
    """
    use = check_config_choice(cfg, "PDL", PDL)
    if not use or device.type != "cuda" or interpreting():
        return {"PDL": False}
    if torch.version.hip is not None:  # a ROCm build names its devices "cuda" too
        raise KernelPreconditionError("PDL: 1 needs CUDA (griddepcontrol is NVIDIA PTX), this is a ROCm build")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise KernelPreconditionError(f"PDL: 1 needs compute capability 9.0 or newer (Hopper's griddepcontrol), "
                                      f"this device is {major}.{minor}")
    return {"PDL": True, "launch_pdl": True}


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    dim: int | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = False,
    unit_last_stride: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one launcher argument; ``None`` entries of ``shape`` match any size.

    Raises:
        KernelPreconditionError: not a tensor, wrong dtype / rank / shape, not contiguous (or last
            stride not 1 when ``unit_last_stride``), or on another device.
    """
    if not isinstance(t, torch.Tensor):
        raise KernelPreconditionError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelPreconditionError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} not in ({allowed})")
    if dim is not None and t.dim() != dim:
        raise KernelPreconditionError(f"{name}: expected {dim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise KernelPreconditionError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KernelPreconditionError(f"{name}: must be contiguous (strides {t.stride()} for shape {list(t.shape)})")
    if unit_last_stride and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelPreconditionError(f"{name}: last dimension must have stride 1, got strides {t.stride()}")
    if device is not None and t.device != device:
        raise KernelPreconditionError(f"{name}: on {t.device}, expected {device} like the other arguments")
    return t


def check_same_dtype(pairs: Iterable[tuple[str, torch.Tensor]]) -> torch.dtype:
    """All named tensors share one dtype; returns it.

    Raises:
        KernelPreconditionError: naming the first mismatch.
    """
    pairs = list(pairs)
    first_name, first = pairs[0]
    for name, t in pairs[1:]:
        if t.dtype != first.dtype:
            raise KernelPreconditionError(
                f"{name}: dtype {str(t.dtype).removeprefix('torch.')} differs from {first_name} "
                f"({str(first.dtype).removeprefix('torch.')}); kernels compute in one dtype"
            )
    return first.dtype


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    """A host int >= ``minimum``.

    Raises:
        KernelPreconditionError: not an int, or too small.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KernelPreconditionError(f"{name}: must be an int >= {minimum}, got {value!r}")
    return value


def check_config_choice(cfg: dict, key: str, allowed: tuple[int, ...]) -> int:
    """A launch config's ``cfg[key]``, an int among ``allowed`` (the values its kernel compiles).

    Raises:
        KernelPreconditionError: not an int of ``allowed`` (a bool or float included), named by ``key``.
    """
    value = cfg[key]
    if type(value) is not int or value not in allowed:
        raise KernelPreconditionError(f"{key}: must be one of {allowed}, got {value!r}")
    return value


def check_grid(name: str, grid: tuple[int, ...]) -> tuple[int, ...]:
    """A launch grid within CUDA's limits: axis 0 <= 2**31 - 1, axes 1 and 2 <= 65535.

    Raises:
        KernelPreconditionError: an axis would exceed its limit (the batch is too large for one launch).
    """
    for axis, size in enumerate(grid):
        limit = MAX_GRID_AXIS0 if axis == 0 else MAX_GRID_AXIS
        if size > limit:
            raise KernelPreconditionError(f"{name}: grid axis {axis} of {size} programs exceeds {limit}")
    return grid


def check_rank_bound(max_rank: int | None, pool_rank: int, what: str = "max_rank") -> int:
    """The host rank bound a launcher tiles for: ``max_rank`` (<= the pool's R) or R.

    Raises:
        KernelPreconditionError: ``max_rank`` > R (the buffers hold no such columns) or < 1.
    """
    if max_rank is None:
        return pool_rank
    check_positive_int(what, max_rank)
    if max_rank > pool_rank:
        raise KernelPreconditionError(f"{what}: rank {max_rank} > the pool's max rank R={pool_rank}")
    return max_rank


def check_rank_covers(max_rank: int | None, weights: LoRAWeights, modules: Iterable[str]) -> None:
    """A host ``max_rank`` at or above every loaded slot's rank of ``modules`` (from the pool's host
    ranks; None, the pool's R, always covers). Launchers that take a ``LoRAWeights`` check it: the
    kernels clamp a slot's rank loop to ``max_rank``, which would silently cut a larger adapter.
    Stricter than "every active slot" (which slots a batch uses is device data): a loaded slot the
    batch does not use counts too.

    Raises:
        KernelPreconditionError: naming the first module and slot whose rank exceeds ``max_rank``.
    """
    if max_rank is None:
        return
    for module in modules:
        for slot, rank in enumerate(weights.host_ranks[module]):
            if rank > max_rank:
                raise KernelPreconditionError(
                    f"max_rank: {max_rank} < rank {rank} of slot {slot} ({module}); the kernels would cut its rank "
                    f"loop. Pass the largest loaded rank (or None for the pool's R)")


def check_align_pairs(align: AlignOutput, num_pairs: int) -> None:
    """An alignment recorded for this launch's pair count (unknown counts pass: a hand-built one).

    Raises:
        KernelPreconditionError: ``align.num_pairs`` differs from ``num_pairs``: its padding rows
            hold ``align.num_pairs``, which this launch would take for a real pair (or its pairs
            would not be this launch's).
    """
    if align.num_pairs is not None and align.num_pairs != num_pairs:
        raise KernelPreconditionError(
            f"align: written for {align.num_pairs} pairs (M*top_k; its padding rows hold {align.num_pairs}), but "
            f"this launch has {num_pairs} pairs; align this launch's topk_ids (one alignment per batch shape)")
