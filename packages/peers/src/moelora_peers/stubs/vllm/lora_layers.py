"""Stands in for the ``vllm.lora.layers`` package ``__init__`` (every LoRA layer class of vLLM:
linear, embedding, logits, fused MoE, each importing the model executor).

Provides: ``LoRAMapping`` and ``LoRAMappingType`` (the per-token / per-request LoRA id mapping the
punica wrapper's ``update_metadata`` reads: ``index_mapping`` per token, ``prompt_mapping`` per
sampled row, ids > 0, 0 = no LoRA), with vLLM's fields and ``__post_init__``. Its submodule
``vllm.lora.layers.utils`` is stubbed too (``moelora_peers.stubs.vllm.lora_layers_utils``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

IS_PACKAGE = True


class LoRAMappingType(Enum):
    LANGUAGE = 1
    TOWER = 2
    CONNECTOR = 3


@dataclass
class LoRAMapping:
    index_mapping: tuple[int, ...]
    prompt_mapping: tuple[int, ...]
    is_prefill: bool = False
    type: LoRAMappingType = LoRAMappingType.LANGUAGE

    def __post_init__(self) -> None:
        self.index_mapping = tuple(self.index_mapping)
        self.prompt_mapping = tuple(self.prompt_mapping)
