"""One graph API for CUDA and CPU (DESIGN.md §6), and the host-sync guard.

- :class:`GraphPool` / :func:`graph_pools`: one pool per family ("decode", "prefill");
  ``pool.capture(fn)`` returns a :class:`CapturedGraph` whose ``replay()`` re-runs the work on
  the current contents of the static inputs. ``kind`` is "cuda" (``torch.cuda.CUDAGraph``) on a
  CUDA device and "emulated" (the emulator, :mod:`.emulator`) elsewhere.
- :class:`LayerGraph`: the layer harness graph modes "full" and "breakable".
- :func:`host_sync_guard`: fail on host syncs in an eager forward.
- :func:`mark_host_memory` / :func:`pin_host_memory`: host buffers graphs may copy from (the
  CPU twin of pinned memory).

See ``packages/core/docs/graphs.md`` for the emulator's semantics and its known differences
from CUDA.
"""

from moelora_core.graphs.emulator import EmulatedGraph
from moelora_core.graphs.host_memory import is_pinned_host, mark_host_memory, pin_host_memory
from moelora_core.graphs.host_sync_guard import host_sync_guard
from moelora_core.graphs.layer_modes import LayerGraph
from moelora_core.graphs.pool import GRAPH_KINDS, CapturedGraph, CudaGraph, GraphPool, collector_paused, graph_pools

__all__ = [
    "GRAPH_KINDS",
    "CapturedGraph",
    "CudaGraph",
    "EmulatedGraph",
    "GraphPool",
    "LayerGraph",
    "collector_paused",
    "graph_pools",
    "host_sync_guard",
    "is_pinned_host",
    "mark_host_memory",
    "pin_host_memory",
]
