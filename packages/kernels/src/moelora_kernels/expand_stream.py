"""How the MoE-LoRA expand reads its factor tiles: the config key ``EXPAND_STREAM`` turned into the
kernels' ``RANK_ALIGN`` and ``EXPAND_STAGES`` (``_moe_lora_kernels`` module docstring).

The expand's t [BLOCK_M, BLOCK_R] and B [BLOCK_R, BLOCK_N] tiles run along the rank, their contiguous
dimension. Masked at each slot's exact rank (value 0), the mask varies inside every 16-byte vector, so
Triton 3.6 loads them 2 bytes at a time and its pipeliner cannot copy B asynchronously (cp.async
takes 4 bytes or more): the fused kernel's expand loop then waits one memory round trip per column
tile. Value 1 rounds the load mask up to :data:`RANK_VECTOR` columns where R allows it (16-byte
loads; the padding is zeroed in registers, so results are bit-identical); values 2-4 also pipeline
the fused kernel's expand loop that many stages deep, cut to what fits :data:`SHARED_MEMORY_LIMIT`.
``configs/h100.json`` sets 1 on every expand entry (``benchmarks/config_ab.py`` on an H100: faster in
every cell, benchmarks/RESULTS.md); ``configs/h200.json`` keeps 0 until the same A/B has run on an H200
(``ci/gpu/run_expand_stream.sh``).
"""

from __future__ import annotations

from moelora_kernels._common import check_config_choice

#: Values of ``EXPAND_STREAM``: 0 = the expand's t and B tiles masked at the exact rank (2-byte
#: loads); 1 = the load mask rounded up to RANK_VECTOR columns (16-byte loads, the fused kernel's
#: loop as ``EXPAND_LOADS`` orders it); 2-4 = 16-byte loads and the fused kernel's expand loop
#: software-pipelined that many stages deep (the pair's expand, one tile per program, runs them as 1)
EXPAND_STREAM: tuple[int, ...] = (0, 1, 2, 3, 4)
#: Rank columns the expand's rounded load mask covers (16 bytes of bf16 / fp16); used only where the
#: factors' R is a multiple of it, so the rounded mask never passes R.
RANK_VECTOR = 8
#: Shared memory (bytes) one sm_90 block may opt into (H100, H200): the pipelined expand loop's
#: buffers are kept within it (:func:`expand_stages`).
SHARED_MEMORY_LIMIT = 232448


def check_expand_stream(cfg: dict) -> int:
    """The config's ``EXPAND_STREAM``.

    Raises:
        KernelPreconditionError: not one of :data:`EXPAND_STREAM` (a bool or float included).
    """
    return check_config_choice(cfg, "EXPAND_STREAM", EXPAND_STREAM)


def rank_align(stream: int, R: int) -> int:
    """The expand kernels' ``RANK_ALIGN`` for ``EXPAND_STREAM`` = ``stream`` and factors of rank R:
    RANK_VECTOR where stream >= 1 and R is a multiple of it (the rounded mask then never passes R),
    else 1 (the exact mask)."""
    return RANK_VECTOR if stream and R % RANK_VECTOR == 0 else 1


def expand_shared_bytes(stages: int, *, block_m: int, block_r: int, block_n: int, b_bytes: int,
                        out_bytes: int) -> int:
    """Shared memory (bytes) of the fused kernel's expand loop pipelined ``stages`` deep:
    ``stages`` - 1 B tiles [BLOCK_R, BLOCK_N] and old-output tiles [BLOCK_M, BLOCK_N] in flight, one B
    tile re-laid out for the dot after its padding columns are zeroed, and t [BLOCK_M, BLOCK_R]
    (Triton 3.6 on sm_90 allocates exactly this for the Qwen3 tiles; the shrink's buffers are freed
    before the loop)."""
    return ((stages - 1) * block_n * (block_r * b_bytes + block_m * out_bytes)
            + block_r * block_n * b_bytes + block_m * block_r * b_bytes)


def expand_stages(stream: int, **tiles: int) -> int:
    """The fused kernel's ``EXPAND_STAGES`` for ``EXPAND_STREAM`` = ``stream``: 1 (the loop left to
    ``EXPAND_LOADS``) for 0 and 1; else the most stages <= stream whose buffers
    (:func:`expand_shared_bytes` of ``tiles``) fit :data:`SHARED_MEMORY_LIMIT`, 1 if not even 2 do
    (so a deep pipeline asked of wide tiles runs shallower instead of failing at launch)."""
    stages = max(stream, 1)
    while stages > 1 and expand_shared_bytes(stages, **tiles) > SHARED_MEMORY_LIMIT:
        stages -= 1
    return stages
