"""Workers for a tensor / expert-parallel engine: spawned here, or torchrun's.

- :func:`spawn` starts ``world`` processes with ``torch.multiprocessing`` (the ``spawn`` start method,
  so each worker imports torch afresh), gives each a rank, starts the process group
  (:func:`~moelora_runner.parallel.comm.init_group`: gloo on a CPU, NCCL on CUDA, rendezvous on a
  free local port) and runs ``fn(rank, *args)``; it returns every rank's result, in rank order.
  A worker that raises makes :func:`spawn` raise (``torch.multiprocessing.ProcessRaisedException``
  with the worker's traceback).
- :func:`torchrun_rank` reads torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (None when not
  under a launcher); :func:`worker_device` maps "cuda" to the rank's GPU.

On CUDA every worker gets :data:`~moelora_runner.parallel.comm.NO_MULTICAST_ENV` (NVLink multicast off)
before NCCL starts, whoever started it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from moelora_runner.parallel.comm import NO_MULTICAST_ENV, init_group


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of spawned workers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun (or any launcher that sets ``RANK``
    and ``WORLD_SIZE``), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def worker_device(device: str | torch.device, local_rank: int) -> torch.device:
    """The device of a worker: "cuda" (no index) becomes ``cuda:<local_rank>``; others as given."""
    d = torch.device(device)
    return torch.device("cuda", local_rank) if d.type == "cuda" and d.index is None else d


def _worker(rank: int, fn: Callable[..., Any], world: int, port: int, device: str, args: tuple,
            results: Any, timeout_s: float) -> None:
    import torch.distributed as dist

    dev = worker_device(device, rank)
    if dev.type == "cuda":
        os.environ.update(NO_MULTICAST_ENV)
    init_group(rank=rank, world=world, device=dev, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
    try:
        # Plain pickle: torch.multiprocessing would share tensors through file descriptors that die
        # with this process.
        results.put(pickle.dumps((rank, fn(rank, *args))))
        # Every rank tears down together: a rank that destroyed its group and exited while a peer's
        # gloo pairs were still open made the peer abort ("terminate called without an active
        # exception", SIGABRT) in about one CLI run in 25 on two CPU cores.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The result is in the parent's pipe (SimpleQueue.put writes it synchronously) and the group is
    # gone; leave without the interpreter's finalization, where the aborts above were raised by C++
    # thread objects torn down in static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world: int, *args: Any, device: str | torch.device = "cpu",
          timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world`` fresh processes in one process group; their results.

    Args:
        fn: a picklable (module-level) function; its result must be picklable.
        world: processes to start. device: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank).
        timeout_s: the process group's collective timeout (a peer that died fails the others
            after this long instead of hanging them).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a worker raised (its traceback in the message).
        ProcessExitedException: a worker died.
    """
    if torch.device(device).type == "cuda":
        os.environ.update(NO_MULTICAST_ENV)  # inherited by the spawned workers as well
    results = mp.get_context("spawn").SimpleQueue()
    out: dict[int, Any] = {}

    def drain() -> None:
        # Read while the workers run: a result larger than the pipe's buffer blocks its worker's put
        # until someone reads, so reading only after join would deadlock.
        for _ in range(world):
            rank, value = pickle.loads(results.get())
            out[rank] = value

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    context = mp.start_processes(_worker, args=(fn, world, free_port(), str(device), args, results, timeout_s),
                                 nprocs=world, join=False, start_method="spawn")
    while not context.join(timeout=1.0):  # raises as soon as a worker fails
        pass
    reader.join()
    return [out[r] for r in range(world)]
