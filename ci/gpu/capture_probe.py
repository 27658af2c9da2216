"""pytest plugin (``-p capture_probe`` with ci/gpu on sys.path): after every test, report whether
a trivial CUDA graph still captures in this process and whether torch's capture stream is left
capturing; print the original traceback of every failed GraphPool capture. A diagnostic for capture
failures that leak from one test into the next. PROBE_MODE=thread_local|relaxed changes
torch.cuda.graph's capture_error_mode; PROBE_HOST_EMPTY=1 empties the pinned host cache first."""
import functools
import os
import traceback

import torch

from moelora_core.graphs import pool as _pool

_mode = os.environ.get("PROBE_MODE")
if _mode:
    _init = torch.cuda.graph.__init__

    @functools.wraps(_init)
    def _init_mode(self, *args, **kwargs):
        kwargs.setdefault("capture_error_mode", _mode)
        _init(self, *args, **kwargs)

    torch.cuda.graph.__init__ = _init_mode

_after = _pool.GraphPool._after_failed_capture


def _after_logged(self, *args):
    print("\n[probe] failed capture, original exception:\n" + traceback.format_exc(), flush=True)
    _after(self, *args)
    print(f"[probe] after cleanup: {_status()}", flush=True)


_pool.GraphPool._after_failed_capture = _after_logged

if os.environ.get("PROBE_HOST_EMPTY"):
    _cap = _pool.GraphPool._capture_cuda

    def _cap_empty(self, fn, warmup):
        torch.cuda.synchronize()
        torch._C._host_emptyCache()
        return _cap(self, fn, warmup)

    _pool.GraphPool._capture_cuda = _cap_empty


def _status() -> str:
    s = getattr(torch.cuda.graph, "default_capture_stream", None)
    cap_stream = None
    if s is not None:
        with torch.cuda.stream(s):
            cap_stream = torch.cuda.is_current_stream_capturing()
    return (f"current-capturing={torch.cuda.is_current_stream_capturing()} "
            f"capture-stream-capturing={cap_stream} current={torch.cuda.current_stream()}")


def _probe() -> str:
    try:
        torch.cuda.synchronize()
    except Exception as e:
        return f"synchronize-FAILED {e!s:.200}"
    status = _status()
    try:
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(4, device="cuda")
        with torch.cuda.graph(g):
            x += 1
        g.replay()
        torch.cuda.synchronize()
        ok = "capture-ok"
    except Exception as e:
        ok = f"capture-FAILED {type(e).__name__}: {str(e)[:120]}"
    try:
        torch.empty(8, pin_memory=True)
        ok += " pin-ok"
    except Exception as e:
        ok += f" pin-FAILED {str(e)[:80]}"
    return f"{status} {ok}"


def pytest_runtest_teardown(item, nextitem):
    print(f"\n[probe] after {item.nodeid}: {_probe()}", flush=True)
