"""A tiny Triton kernel for the graph tests and the GPU agreement run: add two row blocks, with
the live row count either a host int (frozen at capture) or read on the device.

    x, y, out   (capacity, n_cols) fp32, contiguous
    count       (1,) int32 on the device: live rows (read only when USE_COUNT)
    n_rows      host int: live rows when not USE_COUNT (frozen into a captured launch)

Rows at or past the live count are written as 0; rows past ``capacity`` are never touched.
Imported only where Triton is installed (set TRITON_INTERPRET=1 before importing on a CPU).
"""

import triton
import triton.language as tl


@triton.jit
def _add_rows_kernel(
    # pointers
    x_ptr, y_ptr, out_ptr, count_ptr,
    # sizes
    n_rows, capacity, n_cols,
    # meta-parameters
    ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_COUNT: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    if USE_COUNT:
        limit = tl.load(count_ptr)
    else:
        limit = n_rows
    in_bounds = (rows[:, None] < capacity) & (cols[None, :] < n_cols)
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=in_bounds, other=0.0)
    y = tl.load(y_ptr + offs, mask=in_bounds, other=0.0)
    live = rows[:, None] < limit
    tl.store(out_ptr + offs, tl.where(live, x + y, 0.0), mask=in_bounds)


def add_rows(x, y, out, *, count=None, n_rows=None, rows_per_program=4):
    """out[:live] = x[:live] + y[:live], out[live:] = 0, live from ``count`` (device) or ``n_rows`` (host).

    With a host ``n_rows`` the grid covers only the live rows (a callable grid, evaluated with
    the meta-parameters): the grid and the count are both frozen by a capture.
    """
    capacity, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    if count is not None:
        grid = (triton.cdiv(capacity, rows_per_program),)
        _add_rows_kernel[grid](x, y, out, count, capacity, capacity, n_cols,
                               ROWS=rows_per_program, BLOCK=block, USE_COUNT=True)
    else:
        grid = lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),)
        _add_rows_kernel[grid](x, y, out, x, n_rows, capacity, n_cols,
                               ROWS=rows_per_program, BLOCK=block, USE_COUNT=False)
    return out
