"""The batch spec: what a serving step asks the LoRA layer to do, as host-side Python data.

A :class:`BatchSpec` is what a scheduler knows before the forward: the requests (prefix and extend
lengths, adapter slot or ``NO_ADAPTER``), the forward mode, and the adapter pool's per-slot rank
and σ. Backends turn it into a :class:`~moelora_core.batch_info.LoRABatchInfo` using host lists
only (no device reads). Every field is validated on construction and the error names the field.

Names: a request's ``slot``; the per-request slots ``req_weight_indices`` and offsets
``req_seg_indptr`` (the request segments of ``LoRABatchInfo``). The previous names (``adapter_id``,
``req_to_lora``, ``effective_adapter``) raise :class:`~moelora_core.errors.RenamedError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from moelora_core.adapter_config import fp32_scaling
from moelora_core.errors import InvalidFieldError, RenamedError
from moelora_core.forward_mode import ForwardMode
from moelora_core.sentinels import NO_ADAPTER


def _check_int(field: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldError(field, f"must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidFieldError(field, f"must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True, init=False)
class Request:
    """One request of a batch.

    Attributes:
        slot: adapter slot in ``[0, max_loras)``, or ``NO_ADAPTER`` (-1) for a base request.
        extend_len: tokens this step computes (>= 1; 1 in plain decode).
        prefix_len: tokens already in the KV cache before this step (>= 0). The LoRA layer does
            not read it; it is kept so batches describe real scheduler steps (chunked prefill).
    """

    slot: int
    extend_len: int
    prefix_len: int = 0

    def __init__(self, slot: int | None = None, extend_len: int | None = None, prefix_len: int = 0, *,
                 adapter_id: object = None) -> None:
        if adapter_id is not None:
            raise RenamedError("Request(adapter_id=...)", "Request(slot=...)")
        object.__setattr__(self, "slot", slot)
        object.__setattr__(self, "extend_len", extend_len)
        object.__setattr__(self, "prefix_len", prefix_len)

    @property
    def adapter_id(self) -> int:
        raise RenamedError("Request.adapter_id", "Request.slot")


@dataclass(frozen=True)
class BatchSpec:
    """A validated batch: requests, forward mode and the pool's per-slot rank and σ.

    Attributes:
        forward_mode: EXTEND, DECODE or IDLE.
        requests: the requests in batch order (tokens are laid out request after request).
        max_loras: number of adapter slots of the pool.
        lora_ranks: per slot, the adapter's rank (max over its modules); 0 = empty slot. Tokens of
            a request on a rank-0 slot behave as base tokens (they map to ``NO_ADAPTER``).
        scalings: per slot, the adapter-level σ (α/r or α/√r of the adapter config). Kernels use
            the per-module σ of :class:`~moelora_core.weights.LoRAWeights`, which differs from this
            only where ``rank_pattern`` / ``alpha_pattern`` override a module.

    Raises:
        InvalidFieldError: a slot outside ``[-1, max_loras)``; a negative or zero
            ``extend_len``; a negative ``prefix_len``; unequal lengths in DECODE; requests in an
            IDLE batch; an EXTEND/DECODE batch without requests; ``lora_ranks`` / ``scalings`` not
            of length ``max_loras``; a negative rank; a σ that is not a real number or not finite
            in fp32.
    """

    forward_mode: ForwardMode
    requests: tuple[Request, ...]
    max_loras: int
    lora_ranks: tuple[int, ...]
    scalings: tuple[float, ...]

    def __init__(
        self,
        forward_mode: ForwardMode,
        requests: Sequence[Request],
        max_loras: int,
        lora_ranks: Sequence[int],
        scalings: Sequence[float],
    ) -> None:
        if not isinstance(forward_mode, ForwardMode):
            raise InvalidFieldError("forward_mode", f"must be a ForwardMode, got {forward_mode!r}")
        _check_int("max_loras", max_loras, minimum=1)
        requests = tuple(requests)
        lora_ranks = tuple(lora_ranks)
        # σ is staged into fp32 buffers: a string, NaN/Inf or 1e39 must fail here, by name.
        scalings = tuple(fp32_scaling(f"scalings[{slot}]", s) for slot, s in enumerate(scalings))
        if len(lora_ranks) != max_loras:
            raise InvalidFieldError("lora_ranks", f"must have max_loras={max_loras} entries, got {len(lora_ranks)}")
        if len(scalings) != max_loras:
            raise InvalidFieldError("scalings", f"must have max_loras={max_loras} entries, got {len(scalings)}")
        for slot, rank in enumerate(lora_ranks):
            _check_int(f"lora_ranks[{slot}]", rank, minimum=0)
        for i, req in enumerate(requests):
            if not isinstance(req, Request):
                raise InvalidFieldError(f"requests[{i}]", f"must be a Request, got {type(req).__name__}")
            _check_int(f"requests[{i}].slot", req.slot, minimum=NO_ADAPTER)
            if req.slot >= max_loras:
                raise InvalidFieldError(
                    f"requests[{i}].slot",
                    f"slot {req.slot} is outside [-1, max_loras={max_loras})",
                )
            _check_int(f"requests[{i}].extend_len", req.extend_len, minimum=1)
            _check_int(f"requests[{i}].prefix_len", req.prefix_len, minimum=0)
        if forward_mode is ForwardMode.IDLE and requests:
            raise InvalidFieldError("requests", f"an IDLE batch has no requests, got {len(requests)}")
        if forward_mode is not ForwardMode.IDLE and not requests:
            raise InvalidFieldError("requests", f"a {forward_mode.name} batch needs at least one request")
        if forward_mode is ForwardMode.DECODE:
            lens = {r.extend_len for r in requests}
            if len(lens) != 1:
                raise InvalidFieldError(
                    "requests[*].extend_len", f"DECODE needs one length for every request, got {sorted(lens)}"
                )
        object.__setattr__(self, "forward_mode", forward_mode)
        object.__setattr__(self, "requests", requests)
        object.__setattr__(self, "max_loras", max_loras)
        object.__setattr__(self, "lora_ranks", lora_ranks)
        object.__setattr__(self, "scalings", scalings)

    # --- derived host lists (what backends stage to the device) ---------------------------------

    @property
    def bs(self) -> int:
        """Number of requests."""
        return len(self.requests)

    @cached_property
    def num_tokens(self) -> int:
        """Total tokens of the step (sum of extend lengths; 0 for IDLE)."""
        return sum(r.extend_len for r in self.requests)

    @property
    def tokens_per_request(self) -> int:
        """DECODE only: the common extend length."""
        if self.forward_mode is not ForwardMode.DECODE:
            raise InvalidFieldError(
                "forward_mode", f"tokens_per_request is defined for DECODE, not {self.forward_mode.name}"
            )
        return self.requests[0].extend_len

    @cached_property
    def seq_lens(self) -> tuple[int, ...]:
        """Per request extend length."""
        return tuple(r.extend_len for r in self.requests)

    @cached_property
    def req_seg_indptr(self) -> tuple[int, ...]:
        """[bs + 1] token offsets of each request (exclusive prefix sum of extend lengths)."""
        out = [0]
        for r in self.requests:
            out.append(out[-1] + r.extend_len)
        return tuple(out)

    @cached_property
    def req_weight_indices(self) -> tuple[int, ...]:
        """[bs] the slot each request's tokens use: its slot, or ``NO_ADAPTER`` for a base request or
        a request on a rank-0 (empty) slot."""
        return tuple(self.effective_slot(r.slot) for r in self.requests)

    def effective_slot(self, slot: int) -> int:
        """``slot`` if it names a slot with rank > 0, else ``NO_ADAPTER``."""
        if slot == NO_ADAPTER or self.lora_ranks[slot] == 0:
            return NO_ADAPTER
        return slot

    @property
    def req_to_lora(self) -> tuple[int, ...]:
        raise RenamedError("BatchSpec.req_to_lora", "BatchSpec.req_weight_indices")

    def effective_adapter(self, slot: int) -> int:
        raise RenamedError("BatchSpec.effective_adapter", "BatchSpec.effective_slot")

    @cached_property
    def token_lora_mapping(self) -> tuple[int, ...]:
        """[num_tokens] slot of every token (``NO_ADAPTER`` for base tokens): what a backend's device
        token map must equal (the suite's expected value). The serving path never builds it on the
        host: backends build it on the device from the request segments."""
        out: list[int] = []
        for slot, r in zip(self.req_weight_indices, self.requests):
            out.extend([slot] * r.extend_len)
        return tuple(out)

    @cached_property
    def adapter_enabled(self) -> tuple[int, ...]:
        """[max_loras] 1 for each slot used by at least one token of this batch, else 0 (the expected
        value of the device ``adapter_enabled``)."""
        used = set(self.req_weight_indices)
        return tuple(int(s in used) for s in range(self.max_loras))

    @property
    def has_active_lora(self) -> bool:
        """True when at least one token of the batch uses an adapter (host-side, from host lists)."""
        return any(s != NO_ADAPTER for s in self.req_weight_indices)

    def check_num_tokens(self, num_tokens: int, *, what: str = "x.shape[0]") -> None:
        """Raise if ``num_tokens`` (a tensor's leading size) differs from the batch's token count.

        Raises:
            InvalidFieldError: the lengths do not sum to ``num_tokens``.
        """
        if num_tokens != self.num_tokens:
            raise InvalidFieldError(
                what, f"the requests' extend lengths sum to {self.num_tokens} tokens, but {what} is {num_tokens}"
            )
