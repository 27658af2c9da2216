"""Stands in for ``sglang.srt.layers.moe.utils`` (MoE server flags read from the runtime context).

Provides: ``get_moe_padding_size`` (SGLang's definition: 0 unless ``SGLANG_MOE_PADDING=1``; the AITER
padding is ROCm-only) and ``get_moe_runner_backend`` (``MoeRunnerBackend.AUTO``: the server default,
whose ``.value`` the plan runner strips of ``lora_`` to name the vendor).
"""

from __future__ import annotations

import os
from enum import Enum

TRITON_PADDING_SIZE = 128
AITER_PADDING_SIZE = 128


class MoeRunnerBackend(Enum):
    AUTO = "auto"
    TRITON = "triton"


def get_moe_padding_size(is_aiter_moe: bool) -> int:
    if is_aiter_moe:
        return AITER_PADDING_SIZE
    return TRITON_PADDING_SIZE if bool(int(os.getenv("SGLANG_MOE_PADDING", "0"))) else 0


def get_moe_runner_backend() -> MoeRunnerBackend:
    return MoeRunnerBackend.AUTO
