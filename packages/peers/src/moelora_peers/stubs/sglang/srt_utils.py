"""Stands in for the ``sglang.srt.utils`` package ``__init__`` (``from .common import *``).

Provides: the names of ``moelora_peers.stubs.sglang.srt_utils_common`` (the stub of
``sglang.srt.utils.common``), which call sites import from the package.
"""

from moelora_peers.stubs.sglang.srt_utils_common import *  # noqa: F403
from moelora_peers.stubs.sglang.srt_utils_common import next_power_of_2  # noqa: F401

IS_PACKAGE = True
