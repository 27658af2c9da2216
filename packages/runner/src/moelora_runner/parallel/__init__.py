"""Tensor and expert parallelism on ``torch.distributed`` (DESIGN.md §6; NCCL on GPUs, gloo on CPUs).

- :mod:`.layout`: :class:`ParallelLayout` — ``--tp N`` / ``--ep N``, the supported combinations, each
  rank's slice of heads, MoE intermediate and experts, and the start-up checks (a size that does not
  divide heads / I / experts is refused with the numbers).
- :mod:`.comm`: the process group and the one collective the model uses, ``moelora::all_reduce_``
  (a registered op, so the graph emulator records and replays it like any other op, and a CUDA
  graph captures the NCCL kernel).
- :mod:`.sharding`: each rank's base weights and LoRA factors (which factor is replicated, which is
  sharded, and why no LoRA collective is needed).
- :mod:`.launch`: workers for ``moelora generate --tp N`` (torch.multiprocessing, or torchrun's ranks).
"""

from moelora_runner.parallel.layout import ParallelLayout

__all__ = ["ParallelLayout"]
