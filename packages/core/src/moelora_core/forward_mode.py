"""Forward modes of a serving step (DESIGN.md §3)."""

from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    """What kind of step a batch is.

    - ``EXTEND``: prefill, possibly chunked: each request adds ``extend_len >= 1`` tokens after
      ``prefix_len`` cached ones.
    - ``DECODE``: every request adds the same number of tokens (``tokens_per_request``, 1 for plain
      decoding, more for speculative verification).
    - ``IDLE``: zero tokens. Valid; it must launch no LoRA kernel on stale metadata.
    """

    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"

    @property
    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE
