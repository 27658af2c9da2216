"""moelora_runner: the reference engine (DESIGN.md §6) — real HF MoE checkpoints and PEFT adapters
served in mixed batches, eagerly or on captured graphs (decode graph; prefill ``full`` / ``breakable``),
matching HF + PEFT.

- :class:`Engine` (:mod:`.engine`): the Python API; :class:`EngineRequest` / :class:`RequestOutput`
  (:mod:`.requests`).
- :mod:`.model` (decoder), :mod:`.attention` (KV-cache attention), :mod:`.kv_cache`,
  :mod:`.adapter_pool`, :mod:`.scheduler`, :mod:`.sampler`, :mod:`.model_runner`,
  :mod:`.forward_batch`, :mod:`.graph_config`, :mod:`.graph_runner`, :mod:`.metrics`, :mod:`.cli` (the
  ``moelora`` command).
- errors: :mod:`.errors`.
"""

from moelora_runner.engine import Engine
from moelora_runner.errors import (
    AdapterInUseError,
    AdapterPinnedError,
    DuplicateRequestIdError,
    EngineConfigError,
    EngineError,
    GenerateInterrupted,
    GraphCaptureError,
    InvalidRequestError,
    NoFreeSlotError,
    PromptTooLongError,
    UnknownAdapterError,
)
from moelora_runner.requests import EngineRequest, RequestOutput

__version__ = "0.1.0"

__all__ = [
    "AdapterInUseError",
    "AdapterPinnedError",
    "DuplicateRequestIdError",
    "Engine",
    "EngineConfigError",
    "EngineError",
    "EngineRequest",
    "GenerateInterrupted",
    "GraphCaptureError",
    "InvalidRequestError",
    "NoFreeSlotError",
    "PromptTooLongError",
    "RequestOutput",
    "UnknownAdapterError",
]
