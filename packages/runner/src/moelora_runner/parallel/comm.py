"""The engine's process group and its one collective, ``moelora::all_reduce_``.

Every collective the model issues goes through :meth:`Collectives.all_reduce_`, which calls the
registered op ``torch.ops.moelora.all_reduce_(tensor, group_name)`` (an in-place sum over the group,
complete when it returns). Registering it as an op is what makes the graph modes work under TP/EP:

- the CPU graph emulator records device ops at the dispatcher, so it records this op like any other
  and re-issues the gloo all-reduce at every replay (a bare ``dist.all_reduce`` is a c10d op whose
  work object the emulator cannot wait on: it would run once at capture and never again —
  ``test_the_emulator_replays_the_collective`` pins this);
- under ``torch.cuda.CUDAGraph`` the NCCL all-reduce kernel is captured on the capture stream and
  replayed with the graph (NCCL supports stream capture); nothing here syncs with the host.

Groups are looked up by name (an op's arguments are tensors, numbers and strings): :func:`register`
names a ``ProcessGroup``. At world size 1 nothing is registered and :class:`Collectives` is never
built: the single-rank engine issues no collective and is bitwise the engine without this module.

NVLink multicast (NVLS) stays off on the GPU: :data:`NO_MULTICAST_ENV` is set by :func:`init_group`
before NCCL starts, and by the launchers for every worker.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

#: Set for every worker on GPUs (the multi-GPU runs of this workplace forbid NVLink multicast).
NO_MULTICAST_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                    "NVSHMEM_DISABLE_NVLS": "1"}

_GROUPS: dict[str, dist.ProcessGroup | None] = {}


@torch.library.custom_op("moelora::all_reduce_", mutates_args=("tensor",))
def _all_reduce_op(tensor: torch.Tensor, group_name: str) -> None:
    """Sum ``tensor`` in place over the group named ``group_name`` (blocking on the host for gloo;
    ordered on the current stream for NCCL)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_GROUPS[group_name])


def register(name: str, group: dist.ProcessGroup | None) -> str:
    """Name ``group`` (None = the default group) for :class:`Collectives`; returns ``name``."""
    _GROUPS[name] = group
    return name


class Collectives:
    """The model's collectives over one named group.

    Args:
        group_name: a name given to :func:`register`.
        world: the group's size.
    """

    def __init__(self, group_name: str, world: int) -> None:
        if group_name not in _GROUPS:
            raise KeyError(f"no process group registered as {group_name!r}")
        self.group_name = group_name
        self.world = world

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, any float dtype) over the group in place; returns it."""
        torch.ops.moelora.all_reduce_(tensor, self.group_name)
        return tensor


def init_group(*, rank: int, world: int, device: torch.device, init_method: str | None = None,
               timeout_s: float = 600.0) -> Collectives:
    """Start the default process group (gloo on a CPU, NCCL on CUDA) if none is running and return
    the engine's :class:`Collectives` over it.

    Args:
        rank, world: this process's rank and the world size (torchrun's RANK / WORLD_SIZE).
        device: the engine's device (picks the backend; on CUDA the current device is set to it).
        init_method: a URL (``tcp://127.0.0.1:PORT``); None reads MASTER_ADDR / MASTER_PORT (torchrun).
        timeout_s: how long a collective waits for a peer before failing (a crashed peer must not
            hang the others forever).

    Raises:
        ValueError: a running default group of another size or rank.
    """
    if device.type == "cuda":
        for key, value in NO_MULTICAST_ENV.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(f"torch.distributed runs rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"the engine was asked for rank {rank} of {world}")
    else:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return Collectives(register("world", None), world)
