"""What a caller asks of the engine (:class:`EngineRequest`) and what it gets back (:class:`RequestOutput`).

The fields and defaults are those of one line of ``moelora generate``'s request file (vLLM's
``SamplingParams`` names where one exists): ``request_id``, ``prompt_token_ids`` or ``prompt``,
``adapter`` (None = the base model), ``max_new_tokens`` 16, ``temperature`` 0.0 (greedy),
``top_p`` 1.0, ``top_k`` -1 (off), ``seed`` 0, ``ignore_eos`` False, ``stop_token_ids`` [],
``logprobs`` 0 (top-N logprobs per output token), ``prompt_logprobs`` False, ``n`` 1 (only 1).

Checks here need no model (types, ranges, unknown fields); the engine adds those that do (the
vocabulary, the context, the KV budget, the adapter registry) in ``Engine.add_request``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from moelora_runner.errors import InvalidRequestError

#: finish reasons (vLLM's): "stop" (eos or a stop token), "length" (max_new_tokens or the context),
#: "error" (the request failed; ``RequestOutput.error`` says why).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "error")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class EngineRequest:
    """One generation request.

    Attributes:
        request_id: unique per engine; None = the engine assigns ``"req-<n>"``.
        prompt_token_ids: the prompt as token ids (exactly one of this and ``prompt``).
        prompt: the prompt as text, tokenized with the checkpoint's ``tokenizer.json``.
        adapter: a registered adapter's name, or None for the base model.
        max_new_tokens: tokens to generate (>= 0; 0 runs the prompt only, for ``prompt_logprobs``).
        temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens (-1 = all; >= 1 otherwise).
        seed: seeds the request's own ``torch.Generator`` (results never depend on batch mates).
        ignore_eos: keep generating past the model's eos token.
        stop_token_ids: further tokens that end the request (finish reason "stop").
        logprobs: N >= 0; each output token also gets the N most likely tokens with their logprobs.
        prompt_logprobs: return the logprob of every prompt token (a leading None, vLLM's shape).
        n: completions per prompt; only 1 is served.

    Raises (``validate``):
        InvalidRequestError: a field of the wrong type or out of range, ``n != 1``, both or neither
            of ``prompt`` / ``prompt_token_ids``, an empty prompt.
    """

    request_id: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    adapter: str | None = None
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    prompt_logprobs: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None and not isinstance(self.prompt_token_ids, tuple) \
                and isinstance(self.prompt_token_ids, Sequence) and not isinstance(self.prompt_token_ids, str):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if isinstance(self.stop_token_ids, Sequence) and not isinstance(self.stop_token_ids, (tuple, str)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineRequest:
        """A request from one JSON object (a line of the request file).

        Raises:
            InvalidRequestError: not an object, or a field this class does not have.
        """
        if not isinstance(raw, Mapping):
            raise InvalidRequestError("request", f"must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        rid = raw.get("request_id")
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(_where(rid, unknown[0]), f"unknown field; expected some of {sorted(known)}")
        return cls(**raw)

    def validate(self) -> None:
        """The checks that need no model (see the class doc)."""
        rid = self.request_id
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise InvalidRequestError("request_id", f"must be a non-empty string, got {rid!r}")

        def bad(name: str, problem: str) -> InvalidRequestError:
            return InvalidRequestError(_where(rid, name), problem)

        if not _is_int(self.n) or self.n != 1:
            raise bad("n", f"only n = 1 is served (one completion per request), got {self.n!r}")
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise bad("prompt_token_ids", "give exactly one of prompt_token_ids and prompt")
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise bad("prompt", f"must be a string, got {type(self.prompt).__name__}")
            if not self.prompt:
                raise bad("prompt", "is empty")
        else:
            ids = self.prompt_token_ids
            if not isinstance(ids, tuple) or not all(_is_int(t) for t in ids):
                raise bad("prompt_token_ids", f"must be a list of ints, got {ids!r:.80}")
            if not ids:
                raise bad("prompt_token_ids", "is empty (a request needs at least one prompt token)")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise bad("adapter", f"must be an adapter name or null, got {self.adapter!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", f"must be an int >= 0, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", f"must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise bad("seed", f"must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of ints, got {self.stop_token_ids!r:.80}")
        if not _is_int(self.logprobs) or self.logprobs < 0:
            raise bad("logprobs", f"must be an int >= 0, got {self.logprobs!r}")
        if not isinstance(self.prompt_logprobs, bool):
            raise bad("prompt_logprobs", f"must be true or false, got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _where(request_id: object, name: str) -> str:
    return f"request {request_id!r} {name}" if request_id is not None else name


@dataclass
class RequestOutput:
    """What one request produced.

    Attributes:
        request_id: the request's id.
        adapter: the adapter name, or None.
        prompt_token_ids: the prompt as token ids (tokenized when the request gave text).
        prompt_logprobs: None unless asked; else vLLM's shape: ``None`` for the first token, then
            the logprob of each actual prompt token given the ones before it.
        output_token_ids: generated tokens; a stop token (eos or ``stop_token_ids``) that ended the
            request is included, as vLLM includes it.
        output_logprobs: the logprob of each output token, from the model's distribution (the raw
            log-softmax of the logits, before temperature / top-k / top-p, as vLLM reports it).
        top_logprobs: None unless ``logprobs > 0``; per output token, the N most likely tokens as
            ``{"token_id", "logprob"}`` in descending order.
        finish_reason: "stop", "length" or "error".
        error: for "error": ``{"type": error class name, "message": str}``.
        timings: seconds: ``queued`` (arrival → first scheduled), ``ttft`` (arrival → first output
            token, None without one), ``e2e`` (arrival → finished).
        warnings: what the engine changed about the request as given, one sentence each (e.g.
            ``max_new_tokens`` capped by the model's context); an output line carries the key only
            when there is one.
    """

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[float | None] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[dict[str, float | int]]] | None = None
    finish_reason: str | None = None
    error: dict[str, str] | None = None
    timings: dict[str, float | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_json(self) -> dict[str, Any]:
        """The output line of ``moelora generate`` (JSON-ready)."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "adapter": self.adapter,
            "prompt_token_ids": list(self.prompt_token_ids),
            "prompt_logprobs": self.prompt_logprobs,
            "output_token_ids": list(self.output_token_ids),
            "output_logprobs": list(self.output_logprobs),
            "finish_reason": self.finish_reason,
        }
        if self.top_logprobs is not None:
            out["top_logprobs"] = self.top_logprobs
        if self.error is not None:
            out["error"] = dict(self.error)
        if self.warnings:
            out["warnings"] = list(self.warnings)
        out["timings"] = dict(self.timings)
        return out

    @classmethod
    def refused(cls, request: object, exc: BaseException, *, default_id: str) -> RequestOutput:
        """The output of a request refused before it was queued: its id, adapter and prompt ids as far
        as the (possibly malformed) request gives them (``default_id`` when it has no usable id)."""
        get = request.get if isinstance(request, Mapping) else (lambda name: getattr(request, name, None))
        rid = get("request_id")
        ids = get("prompt_token_ids")
        ids = list(ids) if isinstance(ids, (list, tuple)) and all(_is_int(t) for t in ids) else []
        return cls.failed(rid if isinstance(rid, str) and rid else default_id, get("adapter"), exc, ids)

    @classmethod
    def failed(cls, request_id: str, adapter: object, exc: BaseException,
               prompt_token_ids: Sequence[int] = ()) -> RequestOutput:
        """The output of a request refused or failed with ``exc``."""
        return cls(request_id=request_id, adapter=adapter if isinstance(adapter, str) else None,
                   prompt_token_ids=list(prompt_token_ids), finish_reason="error",
                   error={"type": type(exc).__name__, "message": str(exc)})
