"""Stands in for the ``sglang.srt.batch_invariant_ops`` package (deterministic-inference mode).

Provides: ``is_batch_invariant_mode_enabled`` (False: the server's default, batch-invariant mode is
a server option the layer suite does not turn on).
"""

IS_PACKAGE = True


def is_batch_invariant_mode_enabled() -> bool:
    return False
