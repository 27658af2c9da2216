"""The engine's error classes: one per kind of refusal, each a ``moelora_core.MoeLoraError``.

Every refusal is raised before anything changes: a refused request is never queued, a refused
adapter operation leaves the registry, the slots and every ``LoRAWeights`` pool as they were, and
other requests are unaffected. Adapter files the checkpoint reader refuses raise the reader's own
classes (``moelora_core.checkpoint.ADAPTER_REFUSALS``), unchanged.
"""

from __future__ import annotations

from moelora_core.errors import InvalidFieldError, MoeLoraError


class EngineError(MoeLoraError):
    """Base class of the engine's own refusals."""


class EngineConfigError(InvalidFieldError, EngineError):
    """An engine argument is outside its contract (a dtype the backend does not compute in, more
    adapters per batch than slots, a device the backend does not run on, ...). The message starts
    with the argument's name."""


class InvalidRequestError(InvalidFieldError, EngineError):
    """A request is malformed: an empty prompt, a token id outside the vocabulary, a negative
    ``max_new_tokens``, sampling parameters out of range, ``n > 1``, an unknown field. The message
    starts with ``request '<id>' <field>``."""


class DuplicateRequestIdError(InvalidRequestError):
    """Two requests of one ``generate`` call (or one request file) share a ``request_id``: refused before
    any of them is queued, so an id never gets two results."""


class GenerateInterrupted(KeyboardInterrupt):
    """``Engine.generate`` stopped by Ctrl-C (a ``KeyboardInterrupt``), re-raised with what had finished.

    Attributes:
        outputs: one entry per request given, in input order: its ``RequestOutput`` if it finished (or was
            refused) before the interrupt, else None.
    """

    def __init__(self, outputs: list) -> None:
        super().__init__(f"interrupted: {sum(o is not None for o in outputs)} of {len(outputs)} requests finished")
        self.outputs = outputs


class PromptTooLongError(InvalidRequestError):
    """A prompt longer than the model's context, or a request whose prompt plus ``max_new_tokens``
    can never fit the KV cache budget (it would wait forever)."""


class UnknownAdapterError(EngineError, LookupError):
    """A request or an adapter operation names an adapter that is not registered."""


class AdapterInUseError(EngineError):
    """Reload or unload of an adapter that a running or waiting request uses (DESIGN.md §6: a reload
    never changes a running request's output). Retry once those requests have finished."""


class AdapterPinnedError(EngineError):
    """Unload of a pinned adapter: ``unpin`` it first."""


class NoFreeSlotError(EngineError):
    """No adapter slot can be had now: every slot holds an adapter that is pinned or used by a
    running request (``pin`` of a new adapter then), or every slot is pinned by other adapters (a
    request for an unpinned adapter could then never run)."""


class GraphCaptureError(EngineError):
    """A graph bucket cannot be captured or replayed safely: the backend's ``prepare(batch, family)``
    answered the capture batch with ``Fallback`` or with ``has_active_lora`` False (the LoRA kernels
    would never be recorded, DESIGN.md §3), or its static buffers moved after capture (a replay would
    read the old ones)."""
