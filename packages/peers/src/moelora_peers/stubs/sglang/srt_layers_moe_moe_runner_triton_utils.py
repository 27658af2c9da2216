"""Stands in for the ``sglang.srt.layers.moe.moe_runner.triton_utils`` package ``__init__`` (it
re-exports the base Triton MoE runner ``fused_moe.fused_experts``, whose module imports NCCL
allocators, the DP-attention state and the server's runtime context).

Provides: ``get_config`` / ``override_config`` (SGLang's process-wide MoE config override, None
unless a caller overrides it; ``try_get_optimal_moe_config`` reads it first). The package's own
submodules (``fused_moe_triton_config``, ``moe_align_block_size``) are SGLang's files.
"""

from __future__ import annotations

from contextlib import contextmanager

IS_PACKAGE = True
_state: dict = {"config": None}


@contextmanager
def override_config(config):
    old = _state["config"]
    _state["config"] = config
    try:
        yield
    finally:
        _state["config"] = old


def get_config():
    return _state["config"]
