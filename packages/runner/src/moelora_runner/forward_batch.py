"""One forward step as the model sees it (SGLang's ``ForwardBatch``): host lists from the scheduler,
staged once into device tensors whose shapes are host numbers only.

Tensors (T tokens of the step, bs requests, n rows whose logits are returned), all int64:

=================  ======  =============================================================
field              shape   meaning
=================  ======  =============================================================
input_ids          [T]     token of each row (requests laid out one after another)
positions          [T]     its position in its request (RoPE, causal mask)
out_cache_loc      [T]     KV location each row's K/V is written to
token_rows         [T]     the ``req_to_token`` row of each row's request
req_pool_indices   [bs]    ``req_to_token`` row of each request
seq_lens           [bs]    tokens in each request's cache after this step
logits_indices     [n]     rows whose logits the step returns (sampling rows, prompt logprobs)
=================  ======  =============================================================

``max_context`` (host) is the key width attention gathers per row: the longest ``seq_lens`` entry
in eager mode (a graph runner fixes it at capture). The ``BatchSpec`` and the backend's
``LoRABatchInfo`` of the step travel with it: one ``prepare`` per forward, every layer reads the
same info.

Two ways to the device, each staging a step once: :class:`ForwardBatchStager` stages a step into
fresh tensors of the step's own sizes (eager); :class:`StaticForwardBatch` holds the fields of one
graph family as static buffers allocated once at its largest bucket, and a step is written in place
into the views ``[:tokens]`` / ``[:requests]`` of its bucket with the tails of those views reset (pad
rows: token 0, position 0, the null KV location, the KV table's padding row; DESIGN.md §3). Every
bucket of the family is captured over views of the same buffers (nano-vllm's ``capture_cudagraph``
over ``[:bs]`` slices of one set of graph variables), and the step's live batch (what the LM head and
``breakable``'s eager attention read) is the views of its own rows: no second copy. The model reads
only the fields, so it cannot tell the two apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.forward_mode import ForwardMode
from moelora_core.staging import PinnedStaging
from moelora_core.static_buffer import StaticBuffer

#: Token-level fields, then request-level, then the logits rows (staging order).
_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc", "token_rows")
_REQUEST_FIELDS = ("req_pool_indices", "seq_lens")


@dataclass(frozen=True)
class ForwardBatchHost:
    """The host lists of one step (what the scheduler decided), before staging.

    Attributes:
        batch_spec: the LoRA batch spec (slots, extend and prefix lengths, mode).
        input_ids, positions, out_cache_loc, token_rows: per token (see the module table).
        req_pool_indices, seq_lens: per request.
        logits_indices: rows whose logits are returned, ascending.
    """

    batch_spec: BatchSpec
    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    out_cache_loc: tuple[int, ...]
    token_rows: tuple[int, ...]
    req_pool_indices: tuple[int, ...]
    seq_lens: tuple[int, ...]
    logits_indices: tuple[int, ...]

    @property
    def forward_mode(self) -> ForwardMode:
        return self.batch_spec.forward_mode

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_context(self) -> int:
        return max(self.seq_lens, default=0)


@dataclass
class ForwardBatch:
    """The device side of one step (see the module table). ``host`` keeps the lists it came from
    (None for a graph bucket's static batch, whose rows are the bucket's capacity)."""

    host: ForwardBatchHost | None
    lora_info: LoRABatchInfo
    max_context: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    token_rows: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Rows of the step (a static batch: its token capacity); a host shape."""
        return self.input_ids.shape[0]


class ForwardBatchStager:
    """Stages a :class:`ForwardBatchHost` into fresh device tensors (the eager path), through pinned,
    double-buffered staging with ``non_blocking`` copies (DESIGN.md §3): no host sync.

    Args:
        device: where the tensors go.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging = PinnedStaging(1024, torch.int64, device)

    def stage(self, host: ForwardBatchHost, lora_info: LoRABatchInfo) -> ForwardBatch:
        lists: dict[str, Sequence[int]] = {name: getattr(host, name) for name in
                                           (*_TOKEN_FIELDS, *_REQUEST_FIELDS, "logits_indices")}
        needed = sum(len(v) for v in lists.values())
        if needed > self._staging.capacity:
            # Grow geometrically; the caching host allocator keeps the old pinned buffers alive until
            # the copies that read them are done.
            self._staging = PinnedStaging(max(needed, 2 * self._staging.capacity), torch.int64, self.device)
        tensors: dict[str, torch.Tensor] = {}
        with self._staging.batch() as stage:
            for name, values in lists.items():
                tensors[name] = torch.empty(len(values), dtype=torch.int64, device=self.device)
                stage.copy(values, tensors[name])
        return ForwardBatch(host=host, lora_info=lora_info, max_context=host.max_context, **tensors)


class StaticForwardBatch:
    """The :class:`ForwardBatch` fields of one graph family as static buffers (DESIGN.md §3): allocated
    once at the family's largest bucket; a step of a bucket is written in place into the bucket's
    views by :meth:`write` through pinned staging (one non-blocking copy), the tails of those views
    reset every time.

    Pad values (rows past the step's tokens, requests past its requests, up to the bucket's
    capacity): ``input_ids`` 0, ``positions`` 0, ``out_cache_loc`` the null location, ``token_rows`` /
    ``req_pool_indices`` the KV table's padding row, ``seq_lens`` 0. A pad row so writes its K/V to
    the null location and attends to it alone: finite, and no request's cache is touched. Its outputs
    are discarded. ``logits_indices`` (the step's rows whose logits are returned) is written with the
    same copy and read only by the live batch.

    Args:
        max_tokens, max_requests: the family's largest bucket's token and request capacity.
        max_context: the attention key width fixed at capture (the KV table's width).
        null_location, padding_row: from the KV cache.
        device: where the buffers live.
    """

    def __init__(self, *, max_tokens: int, max_requests: int, max_context: int, null_location: int,
                 padding_row: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.max_context = max_context
        fills = {"input_ids": 0, "positions": 0, "out_cache_loc": null_location, "token_rows": padding_row,
                 "req_pool_indices": padding_row, "seq_lens": 0, "logits_indices": 0}
        self.buffers = {name: StaticBuffer(f"static.{name}", max_requests if name in _REQUEST_FIELDS else max_tokens,
                                           dtype=torch.int64, device=device, fill=fill)
                        for name, fill in fills.items()}
        self._staging = PinnedStaging((len(_TOKEN_FIELDS) + 1) * max_tokens + len(_REQUEST_FIELDS) * max_requests,
                                      torch.int64, device)

    def fits(self, host: ForwardBatchHost, tokens: int | None = None, requests: int | None = None) -> bool:
        """Whether ``host``'s tokens and requests fit a bucket of ``tokens`` / ``requests`` (default: the
        largest); host numbers only."""
        tokens = self.max_tokens if tokens is None else tokens
        requests = self.max_requests if requests is None else requests
        return host.num_tokens <= tokens and len(host.seq_lens) <= requests

    def _rows(self, name: str, tokens: int, requests: int) -> int:
        return requests if name in _REQUEST_FIELDS else tokens

    def write(self, host: ForwardBatchHost, lora_info: LoRABatchInfo | None = None, *, tokens: int | None = None,
              requests: int | None = None) -> ForwardBatch:
        """Write ``host``'s lists into the heads of a bucket's views (``tokens`` / ``requests``, default:
        the largest bucket) and the pad values into the rest of those views.

        Returns:
            The step's live :class:`ForwardBatch`: the views of its own rows and requests (and its
            ``logits_indices``), with ``lora_info``.

        Raises:
            InvalidFieldError: more tokens or requests than the bucket (nothing written).
        """
        tokens = self.max_tokens if tokens is None else tokens
        requests = self.max_requests if requests is None else requests
        for name in (*_TOKEN_FIELDS, *_REQUEST_FIELDS):  # every check before the first write
            self.buffers[name].padded(getattr(host, name), rows=self._rows(name, tokens, requests))
        live: dict[str, torch.Tensor] = {}
        with self._staging.batch() as stage:
            for name in (*_TOKEN_FIELDS, *_REQUEST_FIELDS):
                view = self.buffers[name].write(getattr(host, name), rows=self._rows(name, tokens, requests),
                                                stage=stage)
                live[name] = view[: len(getattr(host, name))]
            live["logits_indices"] = self.buffers["logits_indices"].write(host.logits_indices,
                                                                          rows=len(host.logits_indices), stage=stage)
        return ForwardBatch(host=host, lora_info=lora_info, max_context=host.max_context, **live)

    def forward_batch(self, lora_info: LoRABatchInfo, *, tokens: int | None = None,
                      requests: int | None = None) -> ForwardBatch:
        """The :class:`ForwardBatch` a bucket of ``tokens`` / ``requests`` (default: the largest) is
        captured on: the views of the static buffers, ``max_context`` fixed, with ``lora_info`` (a
        graph family's info: its device fields are that family's static buffers). ``logits_indices``
        is empty: the LM head runs after the replay on the live step's rows."""
        tokens = self.max_tokens if tokens is None else tokens
        requests = self.max_requests if requests is None else requests
        views = {name: self.buffers[name].view(self._rows(name, tokens, requests))
                 for name in (*_TOKEN_FIELDS, *_REQUEST_FIELDS)}
        return ForwardBatch(host=None, lora_info=lora_info, max_context=self.max_context,
                            logits_indices=self.buffers["logits_indices"].view(0), **views)

    def bytes(self) -> int:
        """Device bytes of the buffers."""
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self.buffers.values())
