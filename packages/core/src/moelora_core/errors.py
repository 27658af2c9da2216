"""Error classes shared by every moelora package.

Each class names a kind of problem, so callers (and the conformance suite) can assert on the
class, and each message names the offending field, adapter, key or module with the expected and
found values. Validation happens before anything is written: an error means nothing changed.
"""

from __future__ import annotations


class MoeLoraError(Exception):
    """Base class of every error moelora raises on purpose."""


class InvalidFieldError(MoeLoraError, ValueError):
    """A field of a batch, spec or weight set is outside its contract.

    The message starts with the field's name (``"requests[3].slot: ..."``) so the fault is
    visible without a traceback.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class SlotError(InvalidFieldError):
    """An adapter slot index is outside ``[0, max_loras)``, or a slot operation is refused."""


class KernelPreconditionError(MoeLoraError, ValueError):
    """A kernel launcher refused its arguments (dtype, contiguity, shape, capacity, rank > R).

    Raised on the host before launch, so a bad call never becomes a kernel crash or an
    out-of-bounds read.
    """


class UnsupportedBaseQuantError(MoeLoraError, ValueError):
    """A backend asked to serve a base whose quantization (``LoRALayerSpec.base_quant``) it does not
    declare in ``Capabilities.base_quants``: refused at start-up by the engine and the suite, before any
    weight is read, so a quantized path that would drop or mis-scale the deltas never runs."""

    def __init__(self, backend: str, base_quant: str) -> None:
        self.backend = backend
        self.base_quant = base_quant
        super().__init__(f"backend {backend!r} does not declare base_quant={base_quant}")


class HostSyncError(MoeLoraError, RuntimeError):
    """A host<->device synchronisation happened where the contract forbids one.

    Raised by the host-sync guard and by the CPU graph emulator during capture (where CUDA would
    fail the capture too).
    """


class AdapterError(MoeLoraError, ValueError):
    """Base class of the refusals raised when reading or loading a LoRA adapter.

    Subclasses (one per kind of refusal) live with the readers in ``moelora_core.checkpoint``.
    """


class RenamedError(MoeLoraError, AttributeError):
    """An entry point or field of the protocol's previous version was used: the message names what
    replaces it (``conformance/docs/migration.md`` lists every old name with its new one)."""

    def __init__(self, old: str, new: str) -> None:
        self.old = old
        self.new = new
        super().__init__(f"{old} was renamed or removed: {new} (see conformance/docs/migration.md)")


class RenamedImportError(MoeLoraError, ImportError):
    """A name of the protocol's previous version was imported: the message names what replaces it."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(f"{old} was renamed or removed: {new} (see conformance/docs/migration.md)")
