"""The per-batch inputs of the layer harness, and how they are re-ordered, derived and padded.

A :class:`BatchInputs` is what one forward of the layer reads besides the weights: the batch spec
and, per token row, the MoE activations ``x``, the routing (``topk_ids`` with sentinels,
``topk_weights``; and each further MoE layer's own routing) and the dense projections' inputs.
Rows are laid out request after request, as ``BatchSpec.req_seg_indptr`` says.

- :meth:`BatchInputs.select` keeps requests in a given order (a permutation, or a subset): the
  rows move with their request, so each request sees exactly the same values (properties 3, 4).
- :func:`derive_inputs` draws fresh values for any batch on a case's layer from a seed, with the
  case's routing plan (properties 2, 4, 5 build batch sequences this way).
- :func:`pad_rows` fills graph-capacity rows past the live tokens with fresh random activations
  and *valid* expert ids: a stale token mapping in a tail would then add LoRA to them, visibly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelora_conformance.strategies.batches import runs
from moelora_conformance.strategies.cases import MaterializedCase, MoELoRACase
from moelora_core.batch import BatchSpec
from moelora_core.errors import InvalidFieldError
from moelora_core.forward_mode import ForwardMode


@dataclass
class BatchInputs:
    """One batch and the values its token rows carry.

    Attributes:
        batch: the batch spec (requests in row order).
        x: [T, H] MoE activations in the case dtype (before the break op).
        topk_ids: [T, k] int32 expert ids (negative: not handled here; ``>= E``: fused base experts).
        topk_weights: [T, k] fp32 router weights.
        dense_x: module → [T, in] input of that dense projection (case dtype).
        extra_routing: per MoE layer after the first, its (topk_ids [T, k], topk_weights [T, k]).
    """

    batch: BatchSpec
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    dense_x: dict[str, torch.Tensor]
    extra_routing: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    def select(self, order: Sequence[int]) -> BatchInputs:
        """The batch of requests ``order`` (indices into ``batch.requests``; a permutation or a
        subset), each carrying its own rows. An empty ``order`` gives an IDLE batch.

        Raises:
            InvalidFieldError: an index out of range or repeated.
        """
        b = self.batch
        if len(set(order)) != len(order) or any(not 0 <= i < b.bs for i in order):
            raise InvalidFieldError("order", f"must be distinct request indices in [0, {b.bs}), got {list(order)}")
        starts = b.req_seg_indptr
        rows = [r for i in order for r in range(starts[i], starts[i + 1])]
        mode = b.forward_mode if order else ForwardMode.IDLE
        batch = BatchSpec(mode, [b.requests[i] for i in order], b.max_loras, b.lora_ranks, b.scalings)
        index = torch.tensor(rows, dtype=torch.long, device=self.x.device)
        return BatchInputs(batch, self.x[index], self.topk_ids[index], self.topk_weights[index],
                           {m: t[index] for m, t in self.dense_x.items()},
                           tuple((i[index], w[index]) for i, w in self.extra_routing))

    def describe(self) -> str:
        b = self.batch
        return (f"{b.forward_mode.name} bs={b.bs} T={b.num_tokens} lens={runs(b.seq_lens)} "
                f"prefix={runs(r.prefix_len for r in b.requests)} slots={runs(b.req_weight_indices)}")


def case_inputs(m: MaterializedCase, batch: BatchSpec) -> BatchInputs:
    """The case's own batch with its materialized values."""
    return BatchInputs(batch, m.x, m.topk_ids, m.topk_weights, dict(m.dense_x), tuple(m.extra_routing))


def derive_inputs(case: MoELoRACase, m: MaterializedCase, batch: BatchSpec, seed: int) -> BatchInputs:
    """Fresh values for ``batch`` on the case's layer: activations ~ N(0, 1) and routing drawn with
    the case's routing plan on the batch's token slots (sentinels and boundary ids included; each
    further MoE layer its own, drawn last), from a generator seeded with ``seed`` on the case's device.

    Raises:
        InvalidFieldError: the batch is for another pool size than the case's.
    """
    if batch.max_loras != m.spec.max_loras:
        raise InvalidFieldError("batch.max_loras", f"{batch.max_loras} != the case's {m.spec.max_loras}")
    device = m.x.device
    gen = torch.Generator(device).manual_seed(seed)
    T = batch.num_tokens
    x = torch.randn(T, m.spec.H, generator=gen, device=device).to(m.spec.dtype)
    topk_ids, topk_weights, _ = case.routing.materialize(T, device, gen, batch.token_lora_mapping)
    dense_x = {mod: torch.randn(T, t.shape[1], generator=gen, device=device).to(m.spec.dtype)
               for mod, t in m.dense_x.items()}
    extra = tuple(case.routing.materialize(T, device, gen, batch.token_lora_mapping)[:2] for _ in m.layers)
    return BatchInputs(batch, x, topk_ids, topk_weights, dense_x, extra)


@dataclass
class PaddedRows:
    """Values for the rows of a graph-capacity buffer past the live tokens (all ``capacity`` rows;
    the live head is overwritten per batch)."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    dense_x: dict[str, torch.Tensor]
    extra_routing: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


def _pad_routing(gen: torch.Generator, capacity: int, k: int, E: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, E, (capacity, k), generator=gen, device=device, dtype=torch.int32)
    return ids, 1.0 - torch.rand(capacity, k, generator=gen, device=device)


def pad_rows(m: MaterializedCase, capacity: int, seed: int) -> PaddedRows:
    """Fresh random rows for a graph capacity: activations ~ N(0, 1), expert ids uniform in
    ``[0, E)`` (never a sentinel, so a wrongly mapped pad row really picks up LoRA), router
    weights in (0, 1]; the same for every further MoE layer's routing."""
    device = m.x.device
    gen = torch.Generator(device).manual_seed((seed * 2654435761 + 97) % (2**63))
    k = m.topk_ids.shape[1]
    x = torch.randn(capacity, m.spec.H, generator=gen, device=device).to(m.spec.dtype)
    ids, w = _pad_routing(gen, capacity, k, m.spec.E, device)
    dense_x = {mod: torch.randn(capacity, t.shape[1], generator=gen, device=device).to(m.spec.dtype)
               for mod, t in m.dense_x.items()}
    extra = tuple(_pad_routing(gen, capacity, k, m.spec.E, device) for _ in m.layers)
    return PaddedRows(x, ids, w, dense_x, extra)


def round_up(n: int, multiple: int) -> int:
    return multiple * math.ceil(n / multiple)
