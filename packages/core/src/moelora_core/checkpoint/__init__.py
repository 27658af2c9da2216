"""Readers for real checkpoints: Hugging Face MoE models and PEFT LoRA adapters.

safetensors + JSON only (no transformers, no peft). See ``conformance/docs/checkpoints.md`` for the
supported families, adapter formats and refusals.

- :class:`MoECheckpoint` / :func:`read_checkpoint`: config.json + safetensors (single, sharded, or
  several files), per-expert or fused 3-D experts → :class:`MoEModelConfig` + per-layer tensors
  (:class:`DecoderLayerWeights` with ``MoEBaseWeights``), embeddings, final norm, LM head.
  Qwen2-MoE's shared expert is read into ``DecoderLayerWeights.shared_expert``.
- :func:`read_adapter`: adapter_config.json + adapter_model.safetensors → :class:`AdapterWeights`
  (per layer, module → ``ModuleLoRA`` with its σ), cast to the compute dtype.
- :func:`load_adapter_into_slot`: an adapter into one slot of every layer's ``LoRAWeights``,
  validated first, so a refusal changes nothing.
- :func:`adapter_effect`: whether an adapter (each module) changes anything — the no-op adapters
  the engine and the suite name at load (:class:`AdapterWarning`).
- Refusals: one class per kind (:mod:`.errors`), subclasses of ``moelora_core.AdapterError``.
"""

from moelora_core.checkpoint.adapter_effect import AdapterEffect, AdapterWarning, ModuleEffect, adapter_effect
from moelora_core.checkpoint.adapter_reader import AdapterWeights, read_adapter
from moelora_core.checkpoint.base_reader import MoECheckpoint, read_checkpoint
from moelora_core.checkpoint.errors import (
    ADAPTER_REFUSALS,
    AdapterFormatError,
    AdapterRefusal,
    CheckpointError,
    CheckpointFormatError,
    CheckpointShapeError,
    DoRAError,
    ExpertLayoutError,
    MissingTensorError,
    ModelMismatchError,
    NonFiniteWeightError,
    RankTooLargeError,
    ShapeMismatchError,
    UnmatchedKeysError,
    UnsupportedModelError,
    UnsupportedQuantizationError,
    UnsupportedTargetError,
    VocabularyTargetError,
)
from moelora_core.checkpoint.families import FAMILIES, MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE, Family
from moelora_core.checkpoint.layout import DecoderLayerWeights, ModelWeights
from moelora_core.checkpoint.model_config import MoEModelConfig, read_model_config
from moelora_core.checkpoint.peft_config import PeftAdapterConfig
from moelora_core.checkpoint.slot_loader import load_adapter_into_slot

__all__ = [
    "ADAPTER_REFUSALS",
    "FAMILIES",
    "MIXTRAL",
    "OLMOE",
    "QWEN2_MOE",
    "QWEN3_MOE",
    "AdapterEffect",
    "AdapterFormatError",
    "AdapterRefusal",
    "AdapterWarning",
    "AdapterWeights",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointShapeError",
    "DecoderLayerWeights",
    "DoRAError",
    "ExpertLayoutError",
    "Family",
    "MissingTensorError",
    "MoECheckpoint",
    "MoEModelConfig",
    "ModelMismatchError",
    "ModelWeights",
    "ModuleEffect",
    "NonFiniteWeightError",
    "PeftAdapterConfig",
    "RankTooLargeError",
    "ShapeMismatchError",
    "UnmatchedKeysError",
    "UnsupportedModelError",
    "UnsupportedQuantizationError",
    "UnsupportedTargetError",
    "VocabularyTargetError",
    "adapter_effect",
    "load_adapter_into_slot",
    "read_adapter",
    "read_checkpoint",
    "read_model_config",
]
