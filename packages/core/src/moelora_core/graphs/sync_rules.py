"""What counts as a host<->device synchronisation, op by op (shared by the guard and the emulator).

The rules follow what CUDA does with PyTorch 2.11 (checked on an H200, see
``ci/gpu/graph_agreement.py``):

- reading device data on the host: ``.item()``, ``bool()``, ``int()``, ``float()``, ``.tolist()``,
  ``.cpu()``, ``.numpy()``, printing; at the op level ``aten._local_scalar_dense`` and any op
  that returns a Python value computed from device data (``torch.equal``);
- ops whose output shape depends on device values: ``nonzero``, ``masked_select``, ``unique``,
  ``bincount``, ``repeat_interleave`` without ``output_size``, indexing with a boolean mask
  (``x[mask]``; ``x[mask] = scalar`` is a ``masked_fill`` and is fine; ``x[i] = scalar`` is a fill
  on the device, :func:`is_scalar_setitem`);
- copies between host and device: a blocking copy always synchronises; during a capture CUDA also
  refuses an asynchronous copy unless the host side is pinned;
- a host tensor with more than zero dimensions read by a device op (on CUDA a device mismatch or
  an implicit blocking copy). 0-dim host tensors are scalars: their value is frozen into the op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelora_core.graphs.placement import Placement

aten = torch.ops.aten

#: Tensor methods that read device data on the host, by the name shown in error messages.
SYNC_METHODS: dict[Callable, str] = {
    getattr(torch.Tensor, name): name
    for name in (
        "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__",
        "__repr__", "__str__", "__format__", "__array__", "__contains__", "__reduce_ex__",
    )
    if hasattr(torch.Tensor, name)
}

#: Functions that build a tensor from Python data (a host list, a numpy array, a buffer).
DATA_CREATORS: frozenset[Callable] = frozenset(
    getattr(torch, name)
    for name in ("tensor", "as_tensor", "asarray", "from_numpy", "frombuffer")
    if hasattr(torch, name)
)

#: Factories whose placement follows their ``device=`` argument (absent: host, as on CUDA).
FACTORIES: frozenset[Callable] = frozenset(
    getattr(torch, name)
    for name in (
        "empty", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye", "rand", "randn",
        "randint", "randperm", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices",
    )
    if hasattr(torch, name)
)

_DATA_DEPENDENT_PACKETS = frozenset(
    getattr(aten, name)
    for name in ("nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                 "bincount", "nonzero_numpy", "argwhere")
    if hasattr(aten, name)
)
_INDEX_PACKETS = frozenset(getattr(aten, n) for n in ("index", "_unsafe_index") if hasattr(aten, n))
_INDEX_PUT_PACKETS = frozenset(
    getattr(aten, n) for n in ("index_put_", "index_put", "_index_put_impl_", "_unsafe_index_put") if hasattr(aten, n)
)
_COPY_OPS = frozenset({aten.copy_.default, aten._to_copy.default})
#: Ops that allocate without writing: CUDA records no kernel for them.
ALLOC_ONLY_OPS = frozenset(
    getattr(aten, n).default if n != "empty" else aten.empty.memory_format
    for n in ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
)


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def data_dependent_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict, is_host: Callable) -> str | None:
    """Why ``func(*args, **kwargs)`` has an output shape that depends on device values, or None."""
    packet = func.overloadpacket
    if packet in _DATA_DEPENDENT_PACKETS:
        return f"{packet.__name__} has a data-dependent output shape"
    if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) and len(args) == 1:
        if kwargs.get("output_size") is None:
            return "repeat_interleave(repeats tensor) without output_size has a data-dependent output shape"
    if packet in _INDEX_PACKETS and any(_is_mask(i) for i in (args[1] if len(args) > 1 else ())):
        return "indexing with a boolean mask (x[mask]) has a data-dependent output shape"
    if packet in _INDEX_PUT_PACKETS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [i for i in indices if _is_mask(i)]
        if masks:
            value = args[2] if len(args) > 2 else kwargs.get("values")
            accumulate = (args[3] if len(args) > 3 else kwargs.get("accumulate", False))
            live = [i for i in indices if i is not None]
            # PyTorch turns `x[mask] = host_scalar` into masked_fill_ (no sync); anything else
            # converts the mask to indices with nonzero().
            if len(live) == 1 and not accumulate and value.numel() == 1 and is_host(value):
                return None
            return "index_put with a boolean mask (x[mask] = tensor) converts the mask with nonzero()"
    return None


def copy_direction(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                   placement: Placement) -> tuple[str, bool, bool] | None:
    """For a copy op that crosses host and device: ("h2d" | "d2h", host side pinned, non_blocking).

    Returns None for any other op, and for copies within host or within device memory.
    """
    if func not in _COPY_OPS:
        return None
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        dst_host, src_host = placement.is_host(dst), placement.is_host(src)
        if src_host and not dst_host:
            return ("h2d", placement.is_pinned(src), non_blocking)
        if dst_host and not src_host:
            return ("d2h", placement.is_pinned(dst), non_blocking)
        return None
    # _to_copy changes placement only through device= (CPU runs never cross here: to(device) of
    # host data is handled at the function level).
    src = args[0]
    target = kwargs.get("device")
    if target is None or not placement.by_device_type:
        return None
    target_host = torch.device(target).type == "cpu"
    non_blocking = bool(kwargs.get("non_blocking", False))
    if placement.is_host(src) and not target_host:
        return ("h2d", placement.is_pinned(src), non_blocking)
    if not placement.is_host(src) and target_host:
        return ("d2h", bool(kwargs.get("pin_memory", False)), non_blocking)
    return None


def _basic_index(index: object) -> bool:
    """A basic index (ints, slices, None, Ellipsis, tuples of them): a view, no index tensor. Tensor
    indices keep their own rules (``x[mask] = scalar`` is a ``masked_fill``)."""
    if isinstance(index, tuple):
        return all(_basic_index(i) for i in index)
    return index is None or index is Ellipsis or (isinstance(index, int | slice) and not isinstance(index, bool))


def is_scalar_setitem(args: tuple, placement: Placement) -> bool:
    """Whether ``Tensor.__setitem__(t, index, value)`` writes a Python number into device data
    through a basic index: PyTorch creates the value on ``t``'s device (``scalarToTensor``), so on
    CUDA it is a fill of a view, not a host-to-device copy."""
    if len(args) != 3 or not isinstance(args[0], torch.Tensor) or placement.is_host(args[0]):
        return False
    value = args[2]
    return isinstance(value, bool | int | float) and _basic_index(args[1])
