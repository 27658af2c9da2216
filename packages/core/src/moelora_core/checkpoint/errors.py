"""Errors of the checkpoint and adapter readers: one class per kind of refusal.

Base checkpoints raise subclasses of :class:`CheckpointError`; adapters raise subclasses of
``moelora_core.AdapterError``. Every adapter refusal names the adapter, the key or module
at fault, and, where it applies, what was expected and what was found:

    adapter 'bad_shape': key base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight: wrong
    shape (expected (24, 4), found (23, 4))

A reader raises before it returns anything and before any adapter slot is written, so a refusal
never leaves a half-built adapter or a half-loaded slot behind.
"""

from __future__ import annotations

from moelora_core.errors import AdapterError, MoeLoraError


def _describe(subject: str, problem: str, expected: object, found: object) -> str:
    text = f"{subject}: {problem}" if subject else problem
    parts = [f"{label} {value}" for label, value in (("expected", expected), ("found", found)) if value is not None]
    return f"{text} ({', '.join(parts)})" if parts else text


class CheckpointError(MoeLoraError, ValueError):
    """A base model checkpoint cannot be read as one of the supported MoE families.

    Attributes:
        path: the checkpoint directory.
        subject: the file, config key or tensor key at fault.
        expected, found: what the reader wanted and what the checkpoint holds (None when moot).
    """

    def __init__(
        self, path: object, subject: str, problem: str, *, expected: object = None, found: object = None
    ) -> None:
        self.path = str(path)
        self.subject = subject
        self.problem = problem
        self.expected = expected
        self.found = found
        super().__init__(f"checkpoint {self.path}: {_describe(subject, problem, expected, found)}")


class CheckpointFormatError(CheckpointError):
    """Missing or unreadable files (config.json, safetensors, shard index), a key stored twice, or
    tensors the reader would otherwise ignore (e.g. attention biases)."""


class UnsupportedModelError(CheckpointError):
    """The model family or one of its features is not supported (model_type, dense MLP layers,
    attention biases, non-SiLU experts)."""


class UnsupportedQuantizationError(UnsupportedModelError):
    """A quantized checkpoint moelora does not serve: a ``quant_method`` other than block-scaled fp8
    (MXFP4, GPTQ, AWQ, ...), per-tensor fp8 (no ``weight_block_size``), static activation scales, an
    fp8 tensor where the format has none (a router, a norm, a module listed in
    ``modules_to_not_convert``) (DESIGN.md §1, "Quantized base")."""


class MissingTensorError(CheckpointError):
    """A tensor the family's layout requires is not in the checkpoint."""


class CheckpointShapeError(CheckpointError):
    """A tensor's shape differs from the one the config implies (e.g. a transposed expert stack)."""


class AdapterRefusal(AdapterError):
    """Base of the adapter refusals; ``AdapterError`` subclasses with structured fields.

    Attributes:
        adapter: the adapter's name (its directory name unless given).
        subject: the key, module path or config field at fault ("" when the adapter as a whole is).
        problem: what is wrong, in words.
        expected, found: what moelora wanted and what the adapter holds (None when moot).
    """

    def __init__(
        self, adapter: str, subject: str, problem: str, *, expected: object = None, found: object = None
    ) -> None:
        self.adapter = adapter
        self.subject = subject
        self.problem = problem
        self.expected = expected
        self.found = found
        super().__init__(f"adapter {adapter!r}: {_describe(subject, problem, expected, found)}")


class AdapterFormatError(AdapterRefusal):
    """The adapter's files are missing or malformed, it is not a LoRA adapter, or it uses a LoRA
    feature moelora does not serve (lora bias, fan_in_fan_out, LoRA variants, a factor without its
    partner, σ differing between experts of one module)."""


class DoRAError(AdapterRefusal):
    """DoRA (``use_dora`` or ``lora_magnitude_vector`` weights): the magnitude rescaling is not
    part of the equation moelora serves."""


class VocabularyTargetError(AdapterRefusal):
    """Added tokens, trainable token indices, or LoRA / full copies of the embedding or LM head:
    the adapter changes the vocabulary path, which a multi-LoRA MoE backend does not serve."""


class UnmatchedKeysError(AdapterRefusal):
    """Keys that name no module of the model (up to 5 are listed, with the total count)."""


class ShapeMismatchError(AdapterRefusal):
    """A LoRA factor's shape differs from the one the model and the adapter's rank imply."""


class RankTooLargeError(AdapterRefusal):
    """A module's rank is above the pool's max rank R."""


class NonFiniteWeightError(AdapterRefusal):
    """NaN or Inf in a weight, as stored or after the cast to the compute dtype."""


class UnsupportedTargetError(AdapterRefusal):
    """A target that is a real module of the model but not one moelora applies LoRA to (the router,
    norms, dense MLPs, ``modules_to_save``, other parameters)."""


class ModelMismatchError(AdapterRefusal):
    """The adapter was made for another model: another architecture, or other dims (hidden size,
    experts, layers, attention widths)."""


class ExpertLayoutError(AdapterRefusal):
    """The expert factors do not form one expert layout (per-expert, shared-outer, fully shared),
    read from each factor's expert count: a factor shared (expert count 1) on some layers only, the
    shared side on the wrong factor (gate_up B or down A shared while its partner is per expert),
    or two encodings of the expert factors (3-D ``experts.gate_up_proj`` tensors and PEFT's 2-D
    fused or per-expert keys) in one file."""


#: Every adapter refusal kind, in the order a reader checks them.
ADAPTER_REFUSALS: tuple[type[AdapterRefusal], ...] = (
    AdapterFormatError,
    DoRAError,
    VocabularyTargetError,
    UnsupportedTargetError,
    ModelMismatchError,
    UnmatchedKeysError,
    ExpertLayoutError,
    ShapeMismatchError,
    RankTooLargeError,
    NonFiniteWeightError,
)
