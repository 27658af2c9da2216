"""Which graphs the engine runs (DESIGN.md §6): the prefill mode, the decode graph, the buckets and
when they are captured, resolved once from the engine's arguments, the device and the backend's
declared capabilities.

=====================  ===============================================================================
setting                meaning (default)
=====================  ===============================================================================
``prefill``            "eager", "full" (the whole extend forward captured per token bucket) or
                       "breakable" (the segments between attention calls captured; attention eager).
                       Default: "full" on CUDA when the backend declares it, else "eager"
``decode_graph``       the whole decode forward captured per batch-size bucket. Default: on CUDA when
                       the backend declares the decode family, else off
``max_num_requests``   request slots of every prefill bucket (64: above SGLang's old cap of 32)
``prefill_buckets``    token buckets: 16, 32, 64, ... doubling up to ``max_num_batched_tokens``, which
                       is the last one (a step never has more tokens)
``decode_buckets``     batch-size buckets: 1, 2, 4, 8, 16, 24, 32, then steps of 16 up to ``max_bs``
                       (the engine's ``max_num_seqs``), which is the last one
``capture``            "startup" (every bucket captured when the engine starts: CUDA) or "lazy"
                       (a bucket captured on its first use: the CPU emulator, where capture costs
                       about one eager forward and most buckets are never used)
=====================  ===============================================================================

A prefill bucket of T tokens has ``min(max_num_requests, T)`` request slots: a request has at least
one token, so a batch that fits T tokens and ``max_num_requests`` requests fits that too, and small
buckets launch no programs for request slots they could never fill (every bucket reads views of the
family's one buffer set, allocated at the largest bucket). Empty request slots are zero-length requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moelora_core.capabilities import Capabilities
from moelora_runner.errors import EngineConfigError

#: ``--graph`` values: the prefill mode.
PREFILL_MODES: tuple[str, ...] = ("eager", "full", "breakable")
#: ``capture`` values.
CAPTURE_POLICIES: tuple[str, ...] = ("startup", "lazy")
#: Request slots of a prefill bucket by default (no cap of 32).
DEFAULT_MAX_NUM_REQUESTS = 64
#: The smallest default prefill token bucket.
FIRST_PREFILL_BUCKET = 16


def default_decode_buckets(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16, up to and including ``max_bs``."""
    out = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_bs]
    b = 48
    while b < max_bs and out and out[-1] >= 32:
        out.append(b)
        b += 16
    return (*out, max_bs)


def default_prefill_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """16, 32, 64, ... doubling below ``max_num_batched_tokens``, then ``max_num_batched_tokens``."""
    out, b = [], FIRST_PREFILL_BUCKET
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    return (*out, max_num_batched_tokens)


def parse_buckets(name: str, value: str | Iterable[int]) -> tuple[int, ...]:
    """Buckets from a comma list ("16,32,64") or ints: sorted, duplicates dropped.

    Raises:
        EngineConfigError: empty, not an int, or < 1 (the message names ``name``).
    """
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            items = [int(p) for p in parts]
        except ValueError:
            raise EngineConfigError(name, f"must be a comma list of ints, got {value!r}") from None
    else:
        items = list(value)
    if not items:
        raise EngineConfigError(name, "needs at least one bucket")
    for b in items:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise EngineConfigError(name, f"buckets must be ints >= 1, got {b!r}")
    return tuple(sorted(set(items)))


@dataclass(frozen=True)
class GraphConfig:
    """The resolved graph settings (module table). ``GraphConfig.eager()`` runs nothing as a graph."""

    prefill: str = "eager"
    decode_graph: bool = False
    max_num_requests: int = DEFAULT_MAX_NUM_REQUESTS
    prefill_buckets: tuple[int, ...] = ()
    decode_buckets: tuple[int, ...] = ()
    capture: str = "lazy"

    @classmethod
    def eager(cls) -> GraphConfig:
        return cls()

    @property
    def any_graph(self) -> bool:
        return self.prefill != "eager" or self.decode_graph

    def prefill_requests(self, tokens: int) -> int:
        """Request slots of the prefill bucket of ``tokens`` tokens (see the module doc)."""
        return min(self.max_num_requests, tokens)


def resolve_graph_config(*, device: torch.device, caps: Capabilities, backend: str, graph: str | None,
                         decode_graph: bool | None, max_num_requests: int | None,
                         prefill_token_buckets: str | Iterable[int] | None,
                         decode_batch_buckets: str | Iterable[int] | None, max_num_batched_tokens: int,
                         max_bs: int, capture: str | None) -> GraphConfig:
    """The :class:`GraphConfig` of an engine (defaults in the module table).

    Raises:
        EngineConfigError: an unknown mode or capture policy; a mode or family asked for explicitly
            that the backend does not declare; bad buckets; ``max_num_requests`` < 1.
    """
    on_cuda = device.type == "cuda"
    if graph is None:
        graph = "full" if on_cuda and "full" in caps.prefill_graph_modes else "eager"
    if graph not in PREFILL_MODES:
        raise EngineConfigError("graph", f"must be one of {PREFILL_MODES}, got {graph!r}")
    if graph != "eager" and graph not in caps.prefill_graph_modes:
        raise EngineConfigError("graph", f"backend {backend!r} does not declare the prefill graph mode {graph!r} "
                                f"(it declares {sorted(caps.prefill_graph_modes) or 'none'})")
    if decode_graph is None:
        decode_graph = on_cuda and "decode" in caps.graph_families
    if decode_graph and "decode" not in caps.graph_families:
        raise EngineConfigError("decode_graph", f"backend {backend!r} does not declare the decode graph family")
    requests = DEFAULT_MAX_NUM_REQUESTS if max_num_requests is None else max_num_requests
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise EngineConfigError("max_num_requests", f"must be an int >= 1, got {requests!r}")
    prefill = (default_prefill_buckets(max_num_batched_tokens) if prefill_token_buckets is None
               else parse_buckets("prefill_token_buckets", prefill_token_buckets))
    decode = (default_decode_buckets(max_bs) if decode_batch_buckets is None
              else parse_buckets("decode_batch_buckets", decode_batch_buckets))
    if capture is None:
        capture = "startup" if on_cuda else "lazy"
    if capture not in CAPTURE_POLICIES:
        raise EngineConfigError("graph_capture", f"must be one of {CAPTURE_POLICIES}, got {capture!r}")
    return GraphConfig(prefill=graph, decode_graph=bool(decode_graph), max_num_requests=requests,
                       prefill_buckets=prefill if graph != "eager" else (),
                       decode_buckets=decode if decode_graph else (), capture=capture)
