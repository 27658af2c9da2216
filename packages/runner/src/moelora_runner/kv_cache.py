"""The KV cache: a token-granular pool of K/V rows per layer and a per-request table (SGLang's
``req_to_token``), sized by a token budget.

Layout (L layers, N = ``kv_cache_tokens``, nkv KV heads, d head_dim, W = table width):

=============  ========================  ==================================================
tensor         shape, dtype              meaning
=============  ========================  ==================================================
k, v           [L, N + 1, nkv, d] model  K/V of every cached token, by location
req_to_token   [max_requests + 1, W]     per request row: position p → location; 0 past the
               int32                     request's reservation; the last row is the padding row
=============  ========================  ==================================================

Location 0 is the **null location**: never handed out, so table entries past a request's reservation
(and the pad rows of a graph batch) point at a valid row that attention masks out by position. The
**padding row** (``padding_row``, the table's last row) is never handed out either and always reads
the null location: a graph bucket's pad rows read it and write their K/V to the null location, so
they touch no request's cache.
Attention reads K/V through ``req_to_token`` rows gathered over a host-known width, so no shape
depends on a device value (DESIGN.md §6).

Admission reserves a request's whole span at once — prompt plus ``max_new_tokens``, capped at the
context — and writes its table row then (host lists staged through ``PinnedStaging``): a request
runs only when all of its KV fits, never needs preemption, and frees everything when it finishes.
Allocation is host bookkeeping only (free lists), deterministic: the lowest free row, locations in
free-list order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_core.staging import PinnedStaging

#: The location no request owns (see the module doc).
NULL_LOCATION = 0


@dataclass(frozen=True)
class KVAllocation:
    """One request's reservation: its table row and its locations, position p at ``locs[p]``."""

    row: int
    locs: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.locs)


class KVCache:
    """The KV pool and the request table of one engine.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention geometry.
        num_tokens: N, the token budget (locations 1..N).
        max_requests: requests that can hold a reservation at once (``req_to_token`` has one more
            row: the padding row).
        max_context: W, the table width: the longest reservation (prompt + output) a request may have.
        dtype, device: of the K/V pool.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, max_requests: int,
                 max_context: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_tokens = num_tokens
        self.max_requests = max_requests
        self.max_context = max_context
        self.device = device
        shape = (num_layers, num_tokens + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.req_to_token = torch.zeros(max_requests + 1, max_context, dtype=torch.int32, device=device)
        #: The row of graph pad rows: all null locations, never allocated (see the module doc).
        self.padding_row = max_requests
        self._free_locs: list[int] = list(range(1, num_tokens + 1))
        self._free_rows: list[int] = list(range(max_requests))
        self._staging = PinnedStaging(max_context, torch.int32, device)

    # --- bookkeeping (host only) ---------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        return len(self._free_locs)

    @property
    def used_tokens(self) -> int:
        return self.num_tokens - len(self._free_locs)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def can_allocate(self, n: int) -> bool:
        """Whether a reservation of ``n`` tokens fits now (a free row and ``n`` free locations)."""
        return bool(self._free_rows) and n <= len(self._free_locs) and n <= self.max_context

    def allocate(self, n: int) -> KVAllocation:
        """Reserve ``n`` locations and a table row, and write the row (positions past ``n`` → 0).

        Raises:
            RuntimeError: it does not fit (callers check :meth:`can_allocate` first).
        """
        if not self.can_allocate(n):
            raise RuntimeError(f"KV reservation of {n} tokens does not fit ({self.free_tokens} free tokens, "
                               f"{self.free_rows} free rows, width {self.max_context})")
        row = min(self._free_rows)
        self._free_rows.remove(row)
        locs, self._free_locs = self._free_locs[:n], self._free_locs[n:]
        with self._staging.batch() as stage:
            stage.copy(locs + [NULL_LOCATION] * (self.max_context - n), self.req_to_token[row])
        return KVAllocation(row, tuple(locs))

    def free(self, alloc: KVAllocation) -> None:
        """Give ``alloc``'s row and locations back (the row is reset to the null location)."""
        self.req_to_token[alloc.row].zero_()
        self._free_rows.append(alloc.row)
        self._free_locs.extend(alloc.locs)

    def bytes(self) -> int:
        """Bytes of the K/V pool and the table."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.req_to_token))

    def bytes_per_token(self) -> int:
        """K/V bytes one cached token takes over all layers."""
        L, _, nkv, d = self.k.shape
        return 2 * L * nkv * d * self.k.element_size()
