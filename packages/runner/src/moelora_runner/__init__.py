"""moelora_runner: the reference engine (DESIGN.md §6) — real HF MoE checkpoints and PEFT adapters
served in mixed batches, eagerly or on captured graphs (decode graph; prefill ``full`` / ``breakable``),
matching HF + PEFT.

- :class:`Engine` (:mod:`.engine`): the Python API (:class:`EngineParts`: the components it is built
  with); :class:`EngineRequest` / :class:`RequestOutput` (:mod:`.requests`).
- :mod:`.model` (decoder), :mod:`.attention` (KV-cache attention), :mod:`.kv_cache`,
  :mod:`.adapter_pool`, :mod:`.scheduler`, :mod:`.sampler`, :mod:`.model_runner`,
  :mod:`.forward_batch`, :mod:`.graph_config`, :mod:`.graph_runner`, :mod:`.metrics`, :mod:`.cli` (the
  ``moelora`` command).
- errors: :mod:`.errors`.
"""

from __future__ import annotations

import importlib

#: Each public name → the module that defines it, imported on first use (PEP 562): ``import
#: moelora_runner`` (and so the ``moelora`` console script, ``moelora_runner.cli:main``) stays free of
#: torch until a name is used, so the command's Ctrl-C guard is in place before the heavy imports.
_EXPORTS = {
    "Engine": "moelora_runner.engine",
    "EngineParts": "moelora_runner.engine",
    "EngineRequest": "moelora_runner.requests",
    "RequestOutput": "moelora_runner.requests",
    **{name: "moelora_runner.errors" for name in (
        "AdapterInUseError", "AdapterPinnedError", "DuplicateRequestIdError", "EngineConfigError", "EngineError",
        "GenerateInterrupted", "GraphCaptureError", "InvalidRequestError", "NoFreeSlotError", "PromptTooLongError",
        "UnknownAdapterError")},
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moelora_runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)
