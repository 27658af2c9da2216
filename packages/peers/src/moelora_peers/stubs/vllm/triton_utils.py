"""Stands in for the ``vllm.triton_utils`` package ``__init__``.

The real one turns ``triton`` / ``tl`` into placeholders when no GPU driver is found
(``vllm.triton_utils.importing.HAS_TRITON``), which is the case on a CPU machine: the kernels would
not be Triton kernels at all. Provides ``HAS_TRITON = True`` and the real ``triton``,
``triton.language`` as ``tl`` and ``libdevice`` as ``tldevice`` (Triton's interpreter runs them on a
CPU with ``TRITON_INTERPRET=1``). Its submodules (``allocation``, ...) are vLLM's own files.
"""

import triton  # noqa: F401
import triton.language as tl  # noqa: F401
import triton.language.extra.libdevice as tldevice  # noqa: F401

IS_PACKAGE = True
HAS_TRITON = True
