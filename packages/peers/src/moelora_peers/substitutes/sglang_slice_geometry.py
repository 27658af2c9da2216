"""CPU stand-in for ``sglang.kernels.ops.lora.common.lora_b.slice_geometry`` (CUDA-only).

SGLang's ``slice_geometry(offsets, block_size_n, device, out_offsets=None)`` caches a
``SliceGeometry`` whose two int32 tables live on a CUDA device; on any other device it raises
``ValueError("the expand kernels read their offset tables from a CUDA device")``. SGLang has no
CPU fallback, so this stand-in builds the same ``SliceGeometry`` (SGLang's own NamedTuple, from the
fields its docstring defines) with the tables on the given device:

- ``slice_offsets`` [S+1]: the weight rows of each slice; ``out_offsets`` [S]: the destination
  column of each slice (the weight-row starts when ``out_offsets`` is None);
- ``num_column_tiles``: Σ over slices of ``cdiv(width, block_size_n)``;
- ``uniform_width``: the common slice width, 0 when widths differ; ``out_stride``: the column
  step between slices when every slice starts at ``s * step``, else 0; ``full_tiles``: every width
  a multiple of ``block_size_n``.

Input validation is SGLang's own (``_geometry_inputs``). Installed on the loaded module object only
on a machine without CUDA (:func:`install`); the file is unchanged.
"""

from __future__ import annotations

import itertools
import types

import torch


def make_slice_geometry(shared: types.ModuleType):
    """``slice_geometry`` for the loaded ``sglang.kernels.ops.lora.common.lora_b`` module ``shared``."""
    cache: dict[tuple, object] = {}

    def slice_geometry(offsets, block_size_n, device, out_offsets=None):
        rows, columns = shared._geometry_inputs(offsets, block_size_n, out_offsets)
        key = (rows, columns, block_size_n, torch.device(device))
        geometry = cache.get(key)
        if geometry is None:
            widths = [hi - lo for lo, hi in itertools.pairwise(rows)]
            uniform = widths[0] if len(set(widths)) == 1 else 0
            step = columns[1] if len(columns) > 1 else uniform
            regular = step > 0 and all(c == s * step for s, c in enumerate(columns))
            geometry = cache[key] = shared.SliceGeometry(
                slice_offsets=torch.tensor(rows, dtype=torch.int32, device=device),
                out_offsets=torch.tensor(columns, dtype=torch.int32, device=device),
                num_slices=len(widths),
                num_column_tiles=sum(-(-w // block_size_n) for w in widths),
                uniform_width=uniform,
                out_stride=step if regular else 0,
                full_tiles=all(w % block_size_n == 0 for w in widths),
                block_size_n=block_size_n,
            )
        return geometry

    slice_geometry.__moelora_substitute__ = "CPU stand-in for SGLang's CUDA-only slice_geometry"
    return slice_geometry


def install(shared: types.ModuleType) -> None:
    """Replace ``shared.slice_geometry`` (the loaded module's attribute) by the CPU stand-in, once."""
    if not getattr(shared.slice_geometry, "__moelora_substitute__", None):
        shared.slice_geometry = make_slice_geometry(shared)
