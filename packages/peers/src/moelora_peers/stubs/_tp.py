"""One process, one rank: the tensor-parallel names both peers' kernel modules import."""

from __future__ import annotations


def no_tp(*_args, **_kwargs):
    """A TP collective: raises (the peers' ``fully_sharded`` paths are never run by the layer suite)."""
    raise NotImplementedError("moelora_peers: tensor-parallel collectives are not part of the layer suite "
                              "(the peer's fully_sharded path is not run)")


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0
