"""Argument checks every ``Backend`` makes the same way (DESIGN.md §3, §5).

A backend's ``prepare``, ``init_*_graph`` and delta calls refuse bad input before they write
anything; what they check against the ``LoRALayerSpec`` does not depend on how the backend
computes, so it lives here once (the reference backend and the kernel backends both use it):

- :func:`check_batch`: a ``BatchSpec`` of the spec's slot count with no rank above R;
- :class:`FamilyCapacity`: a graph family's capacities from its ``init_*_graph`` arguments
  (:func:`check_init_sizes`), the ``Fallback`` reason of a batch that does not fit
  (:meth:`FamilyCapacity.fallback_reason`), and :func:`needs_allocation` (a family's static
  buffers are allocated once);
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
from moelora_core.errors import InvalidFieldError
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
    """Check the arguments of an ``init_*_graph`` call, by name: each an int >= 1.

    Raises:
        InvalidFieldError: a bool, a non-int or a value < 1 (the field is the argument's name).
    """
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidFieldError(name, f"must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class FamilyCapacity:
    """The host capacities of one graph family, fixed by its ``init_*_graph`` call (DESIGN.md §3).

    Attributes:
        family: "decode" or "prefill".
        max_requests: requests a batch of the family may hold.
        max_tokens: tokens a batch of the family may hold.
        tokens_per_request: the decode family's tokens per request (every request of a decode batch
            has exactly this many); None for prefill.
    """

    family: str
    max_requests: int
    max_tokens: int
    tokens_per_request: int | None

    @classmethod
    def decode(cls, max_bs: int, tokens_per_request: int = 1) -> FamilyCapacity:
        """The decode family of ``init_decode_graph(max_bs, tokens_per_request)``: ``max_bs``
        requests, ``max_bs * tokens_per_request`` tokens.

        Raises:
            InvalidFieldError: a size that is not an int >= 1.
        """
        check_init_sizes({"max_bs": max_bs, "tokens_per_request": tokens_per_request})
        return cls("decode", max_bs, max_bs * tokens_per_request, tokens_per_request)

    @classmethod
    def prefill(cls, max_num_tokens: int, max_num_requests: int) -> FamilyCapacity:
        """The prefill family of ``init_prefill_graph(max_num_tokens, max_num_requests)``.

        Raises:
            InvalidFieldError: a size that is not an int >= 1.
        """
        check_init_sizes({"max_num_tokens": max_num_tokens, "max_num_requests": max_num_requests})
        return cls("prefill", max_num_requests, max_num_tokens, None)

    def fallback_reason(self, batch: BatchSpec) -> str | None:
        """Why ``batch`` does not fit this family (the ``Fallback`` reason), or None when it fits.

        A decode family takes DECODE batches of its own ``tokens_per_request`` (and IDLE ones);
        any family refuses more requests or tokens than its capacities. Host numbers only.
        """
        if self.tokens_per_request is not None and batch.forward_mode is not ForwardMode.IDLE:
            if batch.forward_mode is not ForwardMode.DECODE:
                return f"{batch.forward_mode.name} batch in the decode graph family"
            if batch.tokens_per_request != self.tokens_per_request:
                return f"tokens_per_request {batch.tokens_per_request} != decode graph's {self.tokens_per_request}"
        if batch.bs > self.max_requests:
            return f"{batch.bs} requests > capacity {self.max_requests} of the {self.family} graph"
        if batch.num_tokens > self.max_tokens:
            return f"{batch.num_tokens} tokens > capacity {self.max_tokens} of the {self.family} graph"
        return None


def needs_allocation(existing: FamilyCapacity | None, requested: FamilyCapacity) -> bool:
    """Whether a family's static buffers must be allocated for ``requested``.

    Static buffers are allocated once (graphs captured on them must stay valid): a second
    ``init_*_graph`` call with the same capacities is a no-op (False), one with others is refused.

    Args:
        existing: the capacities the family was initialised with, or None (not initialised yet).
        requested: the capacities of this call.

    Raises:
        InvalidFieldError: ``existing`` has other capacities (the field is the family's name).
    """
    if existing is None:
        return True
    if existing == requested:
        return False
    raise InvalidFieldError(requested.family, f"graph family already initialised with {existing.max_requests} "
                                              f"requests / {existing.max_tokens} tokens; static buffers are "
                                              f"allocated once")


def initialised_family(families: Mapping[str, F], family: str) -> F:
    """The state of graph family ``family`` in ``families`` (a backend's family name → its state).

    Raises:
        InvalidFieldError: (field ``family``) a name other than "decode" or "prefill", or a family
            whose ``init_*_graph`` was not called.
    """
    if family not in GRAPH_FAMILIES:
        raise InvalidFieldError("family", f"must be None (eager), 'decode' or 'prefill', got {family!r}")
    state = families.get(family)
    if state is None:
        raise InvalidFieldError("family", f"the {family} graph family is not initialised "
                                          f"(call init_{family}_graph first)")
    return state


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
        raise InvalidFieldError(what, f"expected shape {shape} (T = {info.moe.token_lora_mapping.numel()} rows of "
                                      f"the batch info), got {got}")


def check_topk_ids(info: LoRABatchInfo, topk_ids: torch.Tensor, top_k: int,
                   dtypes: tuple[torch.dtype, ...] | None = None) -> int:
    """Check ``topk_ids`` [T, top_k] against the info's T; returns T.

    Args:
        dtypes: the integer dtypes the backend takes; None takes any non-floating dtype.

    Raises:
        InvalidFieldError: (field ``topk_ids``) another shape, a floating dtype, or a dtype not in
            ``dtypes``.
    """
    T = info.moe.token_lora_mapping.numel()
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
