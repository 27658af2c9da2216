"""What a backend declares it can do, and the value it returns when a batch is over capacity."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.fp8_block import BASE_QUANTS

#: Graph families a backend may declare (each owns separate static buffers).
GRAPH_FAMILIES: tuple[str, ...] = ("decode", "prefill")
#: Prefill graph modes of the layer harness and the runner (DESIGN.md §6).
PREFILL_GRAPH_MODES: tuple[str, ...] = ("full", "breakable")


@dataclass(frozen=True)
class Capabilities:
    """A backend's declared features. What is not declared is skipped by the suite as
    "not implemented", shown apart from failures.

    Attributes:
        dtypes: activation/weight dtypes the backend computes in.
        devices: device types ("cpu", "cuda") it runs on.
        graph_families: subset of ``GRAPH_FAMILIES`` it can prepare static buffers for.
        prefill_graph_modes: subset of ``PREFILL_GRAPH_MODES`` its prefill family supports.
        virtual_experts: honours ``LoRALayerSpec.virtual_experts``.
        fused_moe: implements ``moe_forward`` (base MoE and deltas fused).
        max_rank: largest pool rank R it accepts, or None for any.
        max_requests: largest number of requests per batch, or None for no cap.
        fused_shared_experts: accepts expert ids in ``[E, E_base)`` (extra fused experts, e.g. a
            shared expert fused into the base MoE) and adds no LoRA for them (DESIGN.md §1). A
            backend that refuses such ids declares False and the suite does not draw them.
        shared_moe_alignment: implements ``moe_align(topk_ids, info) -> alignment`` and accepts
            ``align=`` in ``moe_gate_up_delta`` / ``moe_down_delta``: the caller aligns once per
            layer forward and hands the same alignment to both stages of that layer
            (``moelora_core.moe_deltas.BackendMoEDeltas``).
        slot_load_hook: implements ``on_slot_loaded(slot, weights)``, called by the pool's owner
            after every load, reload or clear of a slot (``moelora_core.backend.notify_slot_loaded``),
            so a backend may keep its own re-packed copy of the pool (the pool itself is read-only).
        shared_expert_factors: accepts a spec whose ``expert_layout`` stores expert factors once per
            slot ("shared_outer", "fully_shared": ``LoRAWeights`` buffers with expert dim 1, exposed
            with expert stride 0) and reads them through those views, without an expand-copy. The
            suite draws such pools only for a backend declaring it.
        alignment_reads_disabled_slots: the consumer of the backend's own per-slot MoE alignment (the
            ``moe_alignment`` hook the suite's P07 checks exactly) reads the alignment rows of a
            disabled slot (``adapter_enabled[slot] == 0``), so P07 requires them to be all padding
            with count 0 (the contract of DESIGN.md §4; the default). False: its kernels return on a
            disabled slot before any alignment load, and the alignment may leave that slot's rows
            untouched (SGLang's JIT align and ``_fused_moe_lora_kernel``); P07 then checks enabled
            slots only, and P01 / P02 / P09 still judge the outputs.
        base_quants: the ``LoRALayerSpec.base_quant`` values it serves (DESIGN.md §1, "Quantized
            base"). For a deltas-only backend, declaring "fp8_block" promises that its deltas read the
            unquantized activations they are given; a ``fused_moe`` backend's ``moe_forward`` then
            receives the fp8 weights and their scales. The engine and the suite refuse at start-up, with
            ``UnsupportedBaseQuantError``, a backend that does not declare the model's value.
    """

    dtypes: frozenset[torch.dtype]
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    graph_families: frozenset[str] = frozenset()
    prefill_graph_modes: frozenset[str] = frozenset()
    virtual_experts: bool = False
    fused_moe: bool = False
    max_rank: int | None = None
    max_requests: int | None = None
    fused_shared_experts: bool = True
    shared_moe_alignment: bool = False
    slot_load_hook: bool = False
    shared_expert_factors: bool = False
    alignment_reads_disabled_slots: bool = True
    base_quants: frozenset[str] = frozenset({"none"})

    def __post_init__(self) -> None:
        for name in ("dtypes", "devices", "graph_families", "prefill_graph_modes", "base_quants"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        unknown = self.graph_families - set(GRAPH_FAMILIES)
        if unknown:
            raise InvalidFieldError(
                "graph_families", f"unknown {sorted(unknown)}; expected a subset of {GRAPH_FAMILIES}"
            )
        unknown = self.prefill_graph_modes - set(PREFILL_GRAPH_MODES)
        if unknown:
            raise InvalidFieldError(
                "prefill_graph_modes", f"unknown {sorted(unknown)}; expected a subset of {PREFILL_GRAPH_MODES}"
            )
        unknown = self.base_quants - set(BASE_QUANTS)
        if unknown:
            raise InvalidFieldError("base_quants", f"unknown {sorted(unknown)}; expected a subset of {BASE_QUANTS}")
        if self.prefill_graph_modes and "prefill" not in self.graph_families:
            raise InvalidFieldError("prefill_graph_modes", "declared without the 'prefill' graph family")

    @property
    def fp8_block_base(self) -> bool:
        """Whether "fp8_block" is among ``base_quants`` (the suite's P14 runs only then)."""
        return "fp8_block" in self.base_quants

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly form (for report headers)."""
        return {
            "dtypes": sorted(str(d).removeprefix("torch.") for d in self.dtypes),
            "devices": sorted(self.devices),
            "graph_families": sorted(self.graph_families),
            "prefill_graph_modes": sorted(self.prefill_graph_modes),
            "virtual_experts": self.virtual_experts,
            "fused_moe": self.fused_moe,
            "max_rank": self.max_rank,
            "max_requests": self.max_requests,
            "fused_shared_experts": self.fused_shared_experts,
            "shared_moe_alignment": self.shared_moe_alignment,
            "slot_load_hook": self.slot_load_hook,
            "shared_expert_factors": self.shared_expert_factors,
            "alignment_reads_disabled_slots": self.alignment_reads_disabled_slots,
            "base_quants": sorted(self.base_quants),
        }


@dataclass(frozen=True)
class Fallback:
    """Returned by ``prepare`` instead of metadata when a batch does not fit a graph family's
    capacity: the caller runs the batch eagerly. No static buffer was written.

    Attributes:
        reason: what did not fit, with the numbers (``"37 requests > capacity 32"``).
    """

    reason: str = field(default="")
