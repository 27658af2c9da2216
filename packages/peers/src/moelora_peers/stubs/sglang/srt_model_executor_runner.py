"""Stands in for the ``sglang.srt.model_executor.runner`` package (the CUDA-graph runners).

Provides: ``get_is_capture_mode`` (SGLang: true while a CUDA graph of the model is being captured)
reading a flag the adapters set around a graph family's delta calls (:func:`capture_mode`), as
SGLang's runner sets ``is_capture_mode`` around capture.
"""

from __future__ import annotations

from contextlib import contextmanager

IS_PACKAGE = True
_state = {"capture": False}


def get_is_capture_mode() -> bool:
    return _state["capture"]


@contextmanager
def capture_mode(on: bool):
    """Set the capture flag for the duration of one delta call."""
    previous = _state["capture"]
    _state["capture"] = on
    try:
        yield
    finally:
        _state["capture"] = previous
