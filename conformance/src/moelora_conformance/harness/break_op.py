"""The harness's break op: an attention-like op between the dense LoRA projection and the MoE layer.

In a decoder layer, attention sits between the q/k/v/o projections and the MoE block and reads
per-request metadata (sequence boundaries) that changes with every batch. The harness models it
with the smallest op of that kind (DESIGN.md §6):

    s[t]     = Σ_m mean_j dense_out_m[t, j]          one number per token from every dense output
    r[q]     = mean of s over the tokens of request q
    moe_in[t] = x[t] · (1 + ½ · tanh(r[request(t)]))   rounded once to x's dtype

so each token's MoE input depends on its own request's dense outputs (a wrong request boundary or a
wrong dense delta changes it) and on nothing else. Without dense modules the factor is exactly 1.

The per-request mean is a one-hot matrix product, not an ``index_add_``: CUDA's atomics would make
the sums (and so the "base rows are bit-identical" property) depend on scheduling.

Two sources of the token → request map:

- :class:`LiveRequests`: built on the host from the batch's host lists at call time (eager runs and
  the ``breakable`` graph mode, where the op runs between two graphs);
- :class:`StaticRequests`: the harness's own static buffers, written in place before each replay
  (the ``full`` graph mode, where the op is replayed with the graph). Pad rows map to a dummy
  request (index ``max_requests``).
"""

from __future__ import annotations

import torch

from moelora_core.batch import BatchSpec

F32 = torch.float32


def token_requests(batch: BatchSpec, rows: int, dummy: int) -> list[int]:
    """[rows] the request index of every token row; rows past the batch's tokens get ``dummy``."""
    out = [q for q, r in enumerate(batch.requests) for _ in range(r.extend_len)]
    return out + [dummy] * (rows - len(out))


def break_op(x: torch.Tensor, dense_out: dict[str, torch.Tensor], request_of: torch.Tensor,
             num_requests: int) -> torch.Tensor:
    """moe_in [T, H] in x's dtype (formula in the module docstring).

    Args:
        x: [T, H] MoE activations.
        dense_out: module → [T, out] dense projection outputs (with their LoRA deltas).
        request_of: [T] int64 request index of every row (a device tensor).
        num_requests: number of request slots (host int; the one-hot width).
    """
    T = x.shape[0]
    s = torch.zeros(T, dtype=F32, device=x.device)
    for out in dense_out.values():
        s = s + out.to(F32).mean(dim=1)
    onehot = (request_of[None, :] == torch.arange(num_requests, device=x.device)[:, None]).to(F32)  # [Q, T]
    sums = onehot @ s
    counts = onehot.sum(dim=1).clamp(min=1.0)
    factor = 1.0 + 0.5 * torch.tanh((sums / counts)[request_of])  # [T]
    return (x.to(F32) * factor[:, None]).to(x.dtype)


def break_op_f64(x: torch.Tensor, dense_out: dict[str, torch.Tensor], batch: BatchSpec) -> torch.Tensor:
    """The same op in float64 on the CPU from host lists, for checking the harness itself."""
    x64 = x.detach().to("cpu", torch.float64)
    T = x64.shape[0]
    s = torch.zeros(T, dtype=torch.float64)
    for out in dense_out.values():
        s += out.detach().to("cpu", torch.float64).mean(dim=1)
    factor = torch.ones(T, dtype=torch.float64)
    starts = batch.req_seg_indptr
    for q in range(batch.bs):
        a, b = starts[q], starts[q + 1]
        factor[a:b] = 1.0 + 0.5 * torch.tanh(s[a:b].mean())
    return x64 * factor[:, None]


class LiveRequests:
    """The token → request map of the current batch, built from host lists when the op runs."""

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.rows = rows
        self.batch: BatchSpec | None = None

    def set_batch(self, batch: BatchSpec) -> None:
        self.batch = batch

    def __call__(self, x: torch.Tensor, dense_out: dict[str, torch.Tensor]) -> torch.Tensor:
        dummy = self.batch.bs
        request_of = torch.tensor(token_requests(self.batch, self.rows, dummy), dtype=torch.long).to(self.device)
        return break_op(x, dense_out, request_of, dummy + 1)


class StaticRequests:
    """The token → request map in a static buffer of ``rows`` entries and ``max_requests + 1``
    request slots (the last one is the pad rows' dummy), written in place before each replay."""

    def __init__(self, device: torch.device, rows: int, max_requests: int) -> None:
        self.max_requests = max_requests
        self.request_of = torch.full((rows,), max_requests, dtype=torch.long, device=device)

    def set_batch(self, batch: BatchSpec) -> None:
        values = token_requests(batch, self.request_of.numel(), self.max_requests)
        self.request_of.copy_(torch.tensor(values, dtype=torch.long))

    def __call__(self, x: torch.Tensor, dense_out: dict[str, torch.Tensor]) -> torch.Tensor:
        return break_op(x, dense_out, self.request_of, self.max_requests + 1)
