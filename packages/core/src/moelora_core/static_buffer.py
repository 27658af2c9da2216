"""Static (graph) buffers: fixed capacity, written in place, unused tail reset (DESIGN.md §3).

A CUDA graph binds the addresses of the tensors it reads at capture. Metadata for later batches
must therefore be written *into* the captured tensors, never into new ones, and whatever a small
batch does not overwrite must be reset, or a replay after a larger batch reads stale entries.
:class:`StaticBuffer` makes both mechanical: ``write`` copies the live values and fills the tail
in the same call, and ``data_ptr`` is fixed for the buffer's life. A graph family allocates its
buffers once, at its largest bucket; a bucket of ``rows`` reads and writes the view
``tensor[:rows]`` (:meth:`StaticBuffer.view`), whose tail up to ``rows`` is reset by every write, so
every bucket's graph reads the same memory, as nano-vllm's ``[:bs]`` views of one set of graph
variables do. The tensor is a normal (not an
inference) tensor wherever it is built, so buffers allocated inside ``torch.inference_mode()`` take
writes outside it and vice versa.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.staging import _StagingWriter


class StaticBuffer:
    """A 1-D device tensor of ``capacity`` elements whose storage never changes.

    Args:
        name: for error messages and address checks.
        capacity: number of elements (worst case of the graph family).
        dtype: element dtype.
        device: where it lives.
        fill: the default tail value (e.g. -1 for mappings and weight indices, 0 for lengths).

    Attributes:
        tensor: the full-capacity tensor; kernels and graphs read this.
    """

    def __init__(
        self, name: str, capacity: int, *, dtype: torch.dtype, device: torch.device | str, fill: int | float
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidFieldError(name, f"capacity must be an int >= 0, got {capacity!r}")
        self.name = name
        self.fill = fill
        # A normal tensor even when built inside torch.inference_mode(): every batch writes it in
        # place, and an inference tensor refuses in-place writes outside inference mode.
        with torch.inference_mode(False):
            self.tensor = torch.full((capacity,), fill, dtype=dtype, device=device)
        self._ptr = self.tensor.data_ptr()

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def data_ptr(self) -> int:
        return self._ptr

    def _rows(self, rows: int | None) -> int:
        if rows is None:
            return self.capacity
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= self.capacity:
            raise InvalidFieldError(self.name, f"rows must be an int in [0, {self.capacity}], got {rows!r}")
        return rows

    def view(self, rows: int | None = None) -> torch.Tensor:
        """``tensor[:rows]`` (the whole tensor when None): what a bucket of ``rows`` reads.

        Raises:
            InvalidFieldError: ``rows`` outside ``[0, capacity]``.
        """
        return self.tensor[: self._rows(rows)]

    def padded(self, values: Sequence[int] | Sequence[float], tail_fill: int | float | None = None,
               rows: int | None = None) -> list:
        """``values`` followed by the tail value up to ``rows`` (default: capacity), a host list.

        Raises:
            InvalidFieldError: more values than ``rows``, or ``rows`` past capacity.
        """
        rows = self._rows(rows)
        n = len(values)
        if n > rows:
            raise InvalidFieldError(self.name, f"{n} values exceed capacity {rows}")
        fill = self.fill if tail_fill is None else tail_fill
        return [*values, *([fill] * (rows - n))]

    def write(
        self,
        values: Sequence[int] | Sequence[float] | torch.Tensor,
        *,
        rows: int | None = None,
        tail_fill: int | float | None = None,
        stage: _StagingWriter | None = None,
    ) -> torch.Tensor:
        """Write ``values`` into the head and ``tail_fill`` (default ``fill``) into the rest of the view
        of ``rows`` (default: the whole buffer), in place.

        Host sequences go through ``stage`` (a pinned staging writer) when given, as one
        non-blocking copy of the whole buffer; device tensors are copied on the device (their
        values are not read back, so only their dtype is checked). Writes run under
        ``torch.no_grad()``: the buffer never records autograd history.

        Returns:
            ``self.view(rows)`` (same storage as before).

        Raises:
            InvalidFieldError: more values than ``rows`` or ``rows`` past capacity; a floating tensor for
                an integer buffer,
                which a copy would truncate; host values outside an integer buffer's range
                (``2**31`` for int32). Nothing is written.
        """
        integer = not self.tensor.dtype.is_floating_point
        view = self.view(rows)
        if isinstance(values, torch.Tensor):
            n = values.numel()
            if n > view.numel():
                raise InvalidFieldError(self.name, f"{n} values exceed capacity {view.numel()}")
            if integer and (values.is_floating_point() or values.is_complex()):
                raise InvalidFieldError(self.name, f"{values.dtype} values for a {self.tensor.dtype} buffer "
                                                   "(a copy would truncate them)")
            with torch.no_grad():
                view[:n].copy_(values.reshape(-1))
                view[n:].fill_(self.fill if tail_fill is None else tail_fill)
        else:
            full = self.padded(values, tail_fill, view.numel())
            self._check_host_values(values)
            with torch.no_grad():
                if stage is not None:
                    stage.copy(full, view)
                else:
                    view.copy_(torch.as_tensor(full, dtype=self.tensor.dtype))
        assert self.tensor.data_ptr() == self._ptr  # in-place by construction
        return view

    def _check_host_values(self, values: Sequence[int] | Sequence[float]) -> None:
        """Refuse host values outside an integer buffer's dtype, which the copy would fail on.

        min/max run in C, so the check costs little on every prepare; host lists come from
        ``BatchSpec``, whose fields are checked ints, so a per-element type check is not made.
        """
        if not len(values) or self.tensor.dtype.is_floating_point or self.tensor.dtype == torch.bool:
            return
        info = torch.iinfo(self.tensor.dtype)
        lo, hi = min(values), max(values)
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            dtype = str(self.tensor.dtype).removeprefix("torch.")
            raise InvalidFieldError(self.name, f"value {bad} is outside {dtype} [{info.min}, {info.max}]")
