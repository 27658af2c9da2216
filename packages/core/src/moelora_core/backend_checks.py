"""Argument checks every ``Backend`` makes the same way (DESIGN.md §3, §5).

A backend's ``prepare``, ``init_graph`` and delta calls refuse bad input before they write
anything; what they check against the ``LoRALayerSpec`` does not depend on how the backend
computes, so it lives here once (the reference backend and the kernel backends both use it):

- :func:`check_batch`: a ``BatchSpec`` of the spec's slot count with no rank above R;
- :class:`GraphCapacity`: what a graph family (its ``init_graph`` capacity) or one of its buckets
  holds (:func:`check_init_sizes`), the ``Fallback`` reason of a batch that does not fit
  (:meth:`GraphCapacity.fallback_reason`), :func:`needs_allocation` (a family's static buffers are
  allocated once), :func:`check_capacity` (a capacity of the family's kind) and :func:`check_bucket`
  (a bucket lies within its family);
- :func:`initialised_family`: the state of a named, initialised graph family;
- the delta calls' host-shape checks: :func:`check_weights`, :func:`check_dense_module`,
  :func:`check_shape`, :func:`check_topk_ids`.

Everything here reads host numbers and tensor shapes only: no device value, no host sync.
Every refusal is an :class:`~moelora_core.errors.InvalidFieldError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import GRAPH_FAMILIES
from moelora_core.errors import InvalidFieldError, RenamedImportError
from moelora_core.forward_mode import ForwardMode
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights

F = TypeVar("F")


def check_batch(batch: BatchSpec, spec: LoRALayerSpec) -> None:
    """Check that ``batch`` fits the pool of ``spec`` (what ``prepare`` checks first).

    Raises:
        InvalidFieldError: ``batch`` is not a ``BatchSpec`` (field ``batch``), has another slot
            count than ``spec.max_loras`` (``batch.max_loras``), or a slot's rank is above
            ``spec.max_rank`` (``batch.lora_ranks[slot]``).
    """
    if not isinstance(batch, BatchSpec):
        raise InvalidFieldError("batch", f"must be a BatchSpec, got {type(batch).__name__}")
    if batch.max_loras != spec.max_loras:
        raise InvalidFieldError("batch.max_loras", f"{batch.max_loras} != spec.max_loras {spec.max_loras}")
    for slot, rank in enumerate(batch.lora_ranks):
        if rank > spec.max_rank:
            raise InvalidFieldError(f"batch.lora_ranks[{slot}]", f"rank {rank} > max_rank {spec.max_rank}")


def check_init_sizes(sizes: Mapping[str, object]) -> None:
    """Check the sizes of a graph capacity, by name: each an int >= 1.

    Raises:
        InvalidFieldError: a bool, a non-int or a value < 1 (the field is the argument's name).
    """
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidFieldError(name, f"must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class GraphCapacity:
    """What a batch of a graph family, or of one bucket of it, may hold (DESIGN.md §3, §6).

    A family's capacity is fixed by its ``init_graph(family, capacity)`` call (its static buffers are
    allocated once, at that size: the family's largest bucket); a bucket's capacity, passed to
    ``prepare(batch, family, bucket=...)``, lies within it and sets the host numbers (grids, segment
    counts) of the graph captured for that bucket.

    Attributes:
        max_requests: requests a batch may hold.
        max_tokens: tokens a batch may hold.
        tokens_per_request: the decode family's tokens per request (every request of a decode batch
            has exactly this many); None for the prefill family.

    Build with :meth:`decode` or :meth:`prefill`, which check the sizes.
    """

    max_requests: int
    max_tokens: int
    tokens_per_request: int | None = None

    @classmethod
    def decode(cls, max_bs: int, tokens_per_request: int = 1) -> GraphCapacity:
        """``max_bs`` decode requests of ``tokens_per_request`` tokens (``max_bs * tokens_per_request`` tokens).

        Raises:
            InvalidFieldError: a size that is not an int >= 1.
        """
        check_init_sizes({"max_bs": max_bs, "tokens_per_request": tokens_per_request})
        return cls(max_bs, max_bs * tokens_per_request, tokens_per_request)

    @classmethod
    def prefill(cls, max_num_tokens: int, max_num_requests: int) -> GraphCapacity:
        """Up to ``max_num_tokens`` tokens in up to ``max_num_requests`` requests (no fixed request cap).

        Raises:
            InvalidFieldError: a size that is not an int >= 1.
        """
        check_init_sizes({"max_num_tokens": max_num_tokens, "max_num_requests": max_num_requests})
        return cls(max_num_requests, max_num_tokens, None)

    def within(self, other: GraphCapacity) -> bool:
        """Whether every batch that fits this capacity fits ``other`` (a bucket within its family)."""
        return (self.max_requests <= other.max_requests and self.max_tokens <= other.max_tokens
                and self.tokens_per_request == other.tokens_per_request)

    def fallback_reason(self, batch: BatchSpec, family: str = "") -> str | None:
        """Why ``batch`` does not fit this capacity (the ``Fallback`` reason), or None when it fits.

        A decode capacity takes DECODE batches of its own ``tokens_per_request`` (and IDLE ones);
        any capacity refuses more requests or tokens. Host numbers only. ``family`` names the
        family in the reason.
        """
        where = f"the {family} graph" if family else "the graph"
        if self.tokens_per_request is not None and batch.forward_mode is not ForwardMode.IDLE:
            if batch.forward_mode is not ForwardMode.DECODE:
                return f"{batch.forward_mode.name} batch in the decode graph family"
            if batch.tokens_per_request != self.tokens_per_request:
                return f"tokens_per_request {batch.tokens_per_request} != decode graph's {self.tokens_per_request}"
        if batch.bs > self.max_requests:
            return f"{batch.bs} requests > capacity {self.max_requests} of {where}"
        if batch.num_tokens > self.max_tokens:
            return f"{batch.num_tokens} tokens > capacity {self.max_tokens} of {where}"
        return None


def check_capacity(family: str, capacity: object) -> GraphCapacity:
    """``capacity`` if it is a ``GraphCapacity`` of ``family``'s kind: the decode family takes
    :meth:`GraphCapacity.decode` capacities (with ``tokens_per_request``), the prefill family
    :meth:`GraphCapacity.prefill` ones.

    Raises:
        InvalidFieldError: (field ``family``) not a graph family; (field ``capacity``) not a
            ``GraphCapacity``, a size that is not an int >= 1, or a capacity of the other kind.
    """
    check_family_name(family)
    if not isinstance(capacity, GraphCapacity):
        raise InvalidFieldError("capacity", f"must be a GraphCapacity, got {type(capacity).__name__}")
    check_init_sizes({"max_requests": capacity.max_requests, "max_tokens": capacity.max_tokens})
    if (family == "decode") != (capacity.tokens_per_request is not None):
        want = "GraphCapacity.decode(max_bs, tokens_per_request)" if family == "decode" else \
            "GraphCapacity.prefill(max_num_tokens, max_num_requests)"
        raise InvalidFieldError("capacity", f"the {family} family takes {want}, got {capacity}")
    tpr = capacity.tokens_per_request
    if tpr is not None:
        check_init_sizes({"tokens_per_request": tpr})
        if capacity.max_tokens != capacity.max_requests * tpr:
            raise InvalidFieldError("capacity", f"{capacity.max_tokens} tokens != {capacity.max_requests} requests x "
                                                f"{tpr} tokens per request")
    return capacity


def needs_allocation(existing: GraphCapacity | None, requested: GraphCapacity, family: str) -> bool:
    """Whether family ``family``'s static buffers must be allocated for ``requested``.

    Static buffers are allocated once (graphs captured on them must stay valid): a second
    ``init_graph`` call with the same capacity is a no-op (False), one with another is refused.

    Args:
        existing: the capacity the family was initialised with, or None (not initialised yet).
        requested: the capacity of this call.

    Raises:
        InvalidFieldError: ``existing`` is another capacity (the field is the family's name).
    """
    if existing is None:
        return True
    if existing == requested:
        return False
    raise InvalidFieldError(family, f"graph family already initialised with {existing.max_requests} requests / "
                                    f"{existing.max_tokens} tokens; static buffers are allocated once (at the "
                                    "family's largest bucket; smaller buckets are prepared with bucket=...)")


def check_bucket(family: str, family_capacity: GraphCapacity, bucket: GraphCapacity | None) -> GraphCapacity:
    """The capacity a graph-mode ``prepare`` is held to: ``bucket``, which must lie within the family's,
    or the family's own when None.

    Raises:
        InvalidFieldError: (field ``bucket``) not a ``GraphCapacity`` or not within the family's capacity.
    """
    if bucket is None:
        return family_capacity
    if not isinstance(bucket, GraphCapacity) or not bucket.within(family_capacity):
        raise InvalidFieldError("bucket", f"{bucket!r} is not within the {family} family's capacity "
                                          f"{family_capacity} (init_graph allocates the largest bucket)")
    return bucket


def initialised_family(families: Mapping[str, F], family: str) -> F:
    """The state of graph family ``family`` in ``families`` (a backend's family name → its state).

    Raises:
        InvalidFieldError: (field ``family``) a name other than "decode" or "prefill", or a family
            whose ``init_graph`` was not called.
    """
    check_family_name(family)
    state = families.get(family)
    if state is None:
        raise InvalidFieldError("family", f"the {family} graph family is not initialised "
                                          f"(call init_graph({family!r}, capacity) first)")
    return state


def check_family_name(family: object) -> str:
    """``family`` if it names a graph family.

    Raises:
        InvalidFieldError: (field ``family``) anything but "decode" or "prefill".
    """
    if family not in GRAPH_FAMILIES:
        raise InvalidFieldError("family", f"must be None (eager), 'decode' or 'prefill', got {family!r}")
    return family


def check_weights(spec: LoRALayerSpec, weights: LoRAWeights, *, same_dtype: bool = True) -> None:
    """Check that ``weights`` is a pool of this spec's sizes (and dtype, unless ``same_dtype`` is False).

    Raises:
        InvalidFieldError: (field ``weights``) not a ``LoRAWeights``, or another (max_loras, E, R,
            H, I) or dtype than ``spec``.
    """
    w = getattr(weights, "spec", None)
    if not isinstance(weights, LoRAWeights) or w is None:
        raise InvalidFieldError("weights", f"must be a LoRAWeights, got {type(weights).__name__}")
    names = ("max_loras", "E", "R", "H", "I") + (("dtype",) if same_dtype else ())
    mine = tuple(getattr(spec, n) for n in names)
    theirs = tuple(getattr(w, n) for n in names)
    if mine != theirs:
        raise InvalidFieldError("weights", f"({', '.join(names)}) = {theirs} != the backend's {mine}")


def check_dense_module(spec: LoRALayerSpec, module: str) -> tuple[int, int]:
    """(in_features, out_features) of dense ``module`` of ``spec``.

    Raises:
        InvalidFieldError: (field ``module``) not a dense module of this spec.
    """
    if module not in spec.dense_shapes:
        raise InvalidFieldError("module", f"{module!r} is not a dense module of this spec "
                                          f"({tuple(spec.dense_shapes)})")
    return spec.dense_shapes[module]


def check_shape(info: LoRABatchInfo, what: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check that argument ``what`` is a tensor of ``shape`` (T = the info's token rows).

    Raises:
        InvalidFieldError: (field ``what``) not a tensor, or another shape.
    """
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise InvalidFieldError(what, f"expected shape {shape} (T = {info.num_tokens} rows of "
                                      f"the batch info), got {got}")


def check_topk_ids(info: LoRABatchInfo, topk_ids: torch.Tensor, top_k: int,
                   dtypes: tuple[torch.dtype, ...] | None = None) -> int:
    """Check ``topk_ids`` [T, top_k] against the info's T (``num_tokens``); returns T.

    Args:
        dtypes: the integer dtypes the backend takes; None takes any non-floating dtype.

    Raises:
        InvalidFieldError: (field ``topk_ids``) another shape, a floating dtype, or a dtype not in
            ``dtypes``.
    """
    T = info.num_tokens
    check_shape(info, "topk_ids", topk_ids, (T, top_k))
    if topk_ids.is_floating_point() or (dtypes is not None and topk_ids.dtype not in dtypes):
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes) if dtypes else "an integer tensor"
        raise InvalidFieldError("topk_ids", f"must be {want}, got {topk_ids.dtype}")
    return T


def check_floating(**tensors: torch.Tensor) -> None:
    """Refuse activations, router weights and outputs of a delta call that are not floating point
    (an integer output would truncate the delta; an integer input is no activation). Each keyword
    names the argument; shared by every backend so the refusal reads the same.

    Raises:
        InvalidFieldError: naming the first such argument.
    """
    for what, t in tensors.items():
        if not t.is_floating_point():
            raise InvalidFieldError(what, f"must be a floating-point tensor, got {t.dtype}")


def __getattr__(name: str) -> object:
    if name == "FamilyCapacity":
        raise RenamedImportError("moelora_core.backend_checks.FamilyCapacity",
                                 "GraphCapacity (GraphCapacity.decode / GraphCapacity.prefill; the family is "
                                 "init_graph's first argument)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
