"""Which rank holds what under ``--tp N`` / ``--ep N`` (the engine's parallel layout).

Supported combinations (``world`` ranks in one group; every rank runs the same scheduler on the same
requests and holds a full replica of everything not listed here):

==============  ======  ==============================================  ===============================
``--tp``/``--ep``  world  attention (q/k/v column-, o row-parallel)      MoE block
==============  ======  ==============================================  ===============================
N / 1            N       heads and kv heads split over the N ranks       gate_up split over I (column),
                                                                         down split over I (row)
1 / N            N       replicated (every rank computes it whole)       experts partitioned, full I
N / N            N       heads split over the N ranks                    experts partitioned over the
                                                                         same N ranks, full I
==============  ======  ==============================================  ===============================

Anything else is refused by name (:class:`~moelora_runner.errors.EngineConfigError`): ``--ep M`` with
``--tp N`` for 1 < M != N would need MoE tensor parallelism inside expert groups (two process groups),
which the engine does not build. EP partitions the experts over the TP group's ranks when both are
given, as SGLang's ``--ep-size == --tp-size`` does.

Collectives per decoder layer: one all-reduce after attention's o projection when attention is split
(tp > 1), one after the MoE block when the MoE is split (world > 1); OLMoE's q/k norm over all heads
adds one small all-reduce of the squared sums under TP. The LoRA deltas ride on these (see
:mod:`.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora_core.checkpoint import MoEModelConfig
from moelora_runner.errors import EngineConfigError


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(name, f"must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelLayout:
    """One rank's place in the layout (module table).

    Attributes:
        tp: attention tensor-parallel size (1 = attention replicated).
        ep: expert-parallel size (1 = all experts on every rank).
        rank: this rank, in ``[0, world)``.

    Raises:
        EngineConfigError: a size that is not an int >= 1, an unsupported (tp, ep) combination, a rank
            outside the world.
    """

    tp: int = 1
    ep: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        tp, ep = _size("tp", self.tp), _size("ep", self.ep)
        if tp > 1 and ep not in (1, tp):
            raise EngineConfigError("ep", f"--ep {ep} with --tp {tp} is not supported: EP partitions the experts "
                                    f"over the TP group's ranks, so --ep must be 1 or {tp} (MoE tensor parallelism "
                                    "inside expert groups would need a second process group)")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise EngineConfigError("rank", f"must be an int in [0, {self.world}), got {self.rank!r}")

    @classmethod
    def single(cls) -> ParallelLayout:
        return cls(1, 1, 0)

    @property
    def world(self) -> int:
        """Ranks in the group: ``max(tp, ep)``."""
        return max(self.tp, self.ep)

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @property
    def moe_mode(self) -> str:
        """How the MoE block is split: "ep" (experts partitioned), "tp" (I split) or "none"."""
        return "ep" if self.ep > 1 else "tp" if self.tp > 1 else "none"

    @property
    def tp_rank(self) -> int:
        """This rank's attention shard (0 when attention is replicated)."""
        return self.rank if self.tp > 1 else 0

    @property
    def moe_tp(self) -> int:
        """Ways the MoE intermediate I is split (tp under MoE TP, else 1)."""
        return self.tp if self.moe_mode == "tp" else 1

    def describe(self) -> str:
        return f"tp={self.tp} ep={self.ep} rank {self.rank}/{self.world} (MoE: {self.moe_mode})"

    # --- what this rank holds --------------------------------------------------------------------

    def check(self, config: MoEModelConfig) -> None:
        """Refuse a layout the model's dims cannot be split into, with the numbers.

        Raises:
            EngineConfigError: tp does not divide the attention heads or the kv heads, the MoE TP size
                does not divide I, ep does not divide the experts or leaves fewer than top_k per rank,
                or a split model has a shared expert or q/k/v biases (Qwen2-MoE: not sharded yet) or MLA
                attention (DeepSeek-V3 / Kimi-K2: MLA, its dense first layers and its shared experts are
                not sharded yet).
        """
        if self.parallel and config.mla is not None:
            raise EngineConfigError("tp" if self.tp > 1 else "ep",
                                    f"{self.describe()} is not supported for a model with MLA attention "
                                    "(DeepSeek-V3 / Kimi-K2): its MLA projections and cache, dense first layers "
                                    "and shared experts are not sharded yet; run it with --tp 1 --ep 1")
        if self.parallel and (config.shared_expert_intermediate_size is not None or config.qkv_bias):
            what = "a shared expert" if config.shared_expert_intermediate_size is not None else "q/k/v biases"
            raise EngineConfigError("tp" if self.tp > 1 else "ep",
                                    f"{self.describe()} is not supported for a model with {what} (Qwen2-MoE): "
                                    "its shared expert and biases are not sharded yet; run it with --tp 1 --ep 1")
        if self.tp > 1:
            for what, n in (("attention heads", config.num_attention_heads),
                            ("key/value heads", config.num_key_value_heads)):
                if n % self.tp:
                    raise EngineConfigError("tp", f"--tp {self.tp} does not divide the model's {n} {what}")
        if self.moe_tp > 1 and config.moe_intermediate_size % self.moe_tp:
            raise EngineConfigError("tp", f"--tp {self.tp} does not divide the MoE intermediate size "
                                    f"{config.moe_intermediate_size}")
        if self.ep > 1 and config.num_experts % self.ep:
            raise EngineConfigError("ep", f"--ep {self.ep} does not divide the model's {config.num_experts} experts")
        if self.ep > 1 and config.num_experts // self.ep < config.top_k:
            # LoRALayerSpec (and the backends' capacities) need top_k <= the layer's experts.
            raise EngineConfigError("ep", f"--ep {self.ep} leaves {config.num_experts // self.ep} experts per rank, "
                                    f"fewer than the model's top_k {config.top_k}")

    def heads(self, config: MoEModelConfig) -> tuple[int, int]:
        """(attention heads, kv heads) on this rank."""
        return config.num_attention_heads // self.tp, config.num_key_value_heads // self.tp

    def intermediate(self, config: MoEModelConfig) -> tuple[int, int]:
        """(start, size) of this rank's slice of the MoE intermediate I."""
        size = config.moe_intermediate_size // self.moe_tp
        return (self.rank * size if self.moe_tp > 1 else 0), size

    def experts(self, config: MoEModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's experts (global ids ``[first, first + count)``)."""
        count = config.num_experts // self.ep
        return (self.rank * count if self.ep > 1 else 0), count
