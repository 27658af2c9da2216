"""One-line faults in the reference backend: each class below is ``ReferenceBackend`` with one
known class of MoE multi-LoRA fault put back in (``docs/suite.md``, "The suite tests itself").

Each fault is one changed line of the reference's logic, kept in the smallest override that holds
it. The suite must catch every one in the ``interpret`` profile without shrinking
(``tests/test_mutations.py``; the table in ``docs/mutations.md``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import moelora_core.checkpoint as checkpoint
from moelora_conformance.faulty.e2e_mutants import HotSlotFrozenAtCapture
from moelora_core.batch import BatchSpec, Request
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.checkpoint import peft_config
from moelora_core.sentinels import NO_ADAPTER
from moelora_core.static_buffer import StaticBuffer
from moelora_core.weights import LoRAWeights, module_index
from moelora_reference.backend import ReferenceBackend


def _with_slots(batch: BatchSpec, slots: list[int]) -> BatchSpec:
    requests = [Request(s, r.extend_len, r.prefix_len) for s, r in zip(slots, batch.requests)]
    return BatchSpec(batch.forward_mode, requests, batch.max_loras, batch.lora_ranks, batch.scalings)


class _StaleTailBuffer(StaticBuffer):
    """A static buffer whose write leaves the tail as the previous batch left it."""

    def padded(self, values, tail_fill=None, rows=None):
        rows = self.capacity if rows is None else rows
        previous = getattr(self, "_last", [self.fill] * self.capacity)
        # FAULT: the tail keeps the previous (larger) batch's entries instead of the reset value.
        full = [*values, *previous[len(values):rows]]
        self._last = full + previous[rows:]
        return full


class StaleTail(ReferenceBackend):
    """Graph families do not reset the token mapping's tail: a small batch replayed after a larger
    one maps its pad rows to the larger batch's adapters."""

    name = "mutant-stale-tail"

    def init_graph(self, family, capacity):
        super().init_graph(family, capacity)
        fam = self._families[family]
        mapper = fam.mapper

        def mapper_keeping_the_tail(indptr, slots, max_loras, mapping_out, enabled_out):
            before = mapping_out.clone()
            mapper(indptr, slots, max_loras, mapping_out, enabled_out)
            # FAULT: rows past the live tokens keep the previous batch's mapping instead of -1.
            live = torch.arange(mapping_out.numel(), device=mapping_out.device) < indptr[-1]
            mapping_out.copy_(torch.where(live, mapping_out, before))

        fam.mapper = mapper_keeping_the_tail


class BaseToSlotZero(ReferenceBackend):
    """Base requests (``NO_ADAPTER``) are mapped to adapter slot 0."""

    name = "mutant-base-to-slot-0"

    def prepare(self, batch, family=None, bucket=None):
        # FAULT: -1 is clamped to slot 0 instead of meaning "no adapter".
        return super().prepare(_with_slots(batch, [max(r.slot, 0) for r in batch.requests]), family, bucket)


class UpUsesGateA(ReferenceBackend):
    """The up projection's delta reads the gate projection's A."""

    name = "mutant-up-uses-gate-A"

    def _moe_factors(self, weights, module):
        A, B = super()._moe_factors(weights, module)
        if module == "up":
            A = super()._moe_factors(weights, "gate")[0]  # FAULT: gate's A for up
        return A, B


class _WeightsViewBackend(ReferenceBackend):
    """The reference backend reading the pool through ``weights_view``, a ``LoRAWeights`` subclass
    that shares every tensor and overrides one accessor (the σ mutants' fault lives there)."""

    weights_view: type[LoRAWeights] = LoRAWeights

    def _view(self, weights: LoRAWeights) -> LoRAWeights:
        view = copy.copy(weights)  # shares every tensor
        view.__class__ = self.weights_view
        return view

    def moe_gate_up_delta(self, x, topk_ids, gate_up_out, weights, info):
        super().moe_gate_up_delta(x, topk_ids, gate_up_out, self._view(weights), info)

    def moe_down_delta(self, h, topk_ids, topk_weights, down_out, weights, info):
        super().moe_down_delta(h, topk_ids, topk_weights, down_out, self._view(weights), info)

    def dense_delta(self, module, x, out, weights, info):
        super().dense_delta(module, x, out, self._view(weights), info)


class _AlphaOverR(LoRAWeights):
    def scalings(self, module: str) -> torch.Tensor:
        ranks = self.ranks(module).to(torch.float32).clamp(min=1.0)
        # FAULT: σ = α/r where the adapter asks α/√r (rsLoRA): the stored α/√r divided by √r again.
        return super().scalings(module) / ranks.sqrt()


class AlphaOverR(_WeightsViewBackend):
    """σ computed as α/r where rsLoRA asks α/√r."""

    name = "mutant-alpha-over-r"
    weights_view = _AlphaOverR


class SentinelToOtherAdapter(ReferenceBackend):
    """Virtual experts: a sentinel expert id (-1) of slot s becomes virtual id ``s·E - 1``, the last
    expert of slot s-1 — another adapter's expert."""

    name = "mutant-sentinel-to-other-adapter"

    def _pair_index(self, topk_ids: torch.Tensor, info: LoRABatchInfo):
        if not self.spec.virtual_experts:
            return super()._pair_index(topk_ids, info)
        L, E = self.spec.max_loras, self.spec.E
        slot = info.token_lora_mapping.long()[:, None].expand_as(topk_ids)
        ids = topk_ids.long()
        # FAULT: the id >= 0 test is missing, so slot·E + (-1) lands on slot s-1's last expert.
        virtual = torch.where((slot >= 0) & (slot < L) & (ids < E), slot * E + ids, torch.full_like(ids, -1))
        valid = virtual >= 0
        v = torch.where(valid, virtual, torch.zeros_like(virtual))
        return valid, (v // E, v % E), v // E  # the reference's (slot, expert) read-back of v


class HostSync(ReferenceBackend):
    """The down delta reads a device value on the host (a hidden ``.item()``)."""

    name = "mutant-host-sync"

    def moe_down_delta(self, h, topk_ids, topk_weights, down_out, weights, info):
        if int(info.adapter_enabled.sum()) == 0:  # FAULT: a host read of device data
            return
        super().moe_down_delta(h, topk_ids, topk_weights, down_out, weights, info)


class RequestCap32(ReferenceBackend):
    """Requests past the 32nd get no adapter (a fixed 32-request table)."""

    name = "mutant-32-request-cap"

    def prepare(self, batch, family=None, bucket=None):
        # FAULT: only the first 32 requests keep their adapter.
        slots = [r.slot if i < 32 else NO_ADAPTER for i, r in enumerate(batch.requests)]
        return super().prepare(_with_slots(batch, slots), family, bucket)


class SharedScratch(ReferenceBackend):
    """The decode and prefill graph families share one set of static buffers."""

    name = "mutant-shared-scratch"

    def init_graph(self, family, capacity):
        super().init_graph(family, capacity)
        other = self._families.get("prefill" if family == "decode" else "decode")
        if other is None:
            return
        for key, mine in self._families[family].buffers.items():
            theirs = other.buffers[key]
            big, small = (theirs, mine) if theirs.capacity >= mine.capacity else (mine, theirs)
            small.tensor = big.tensor[: small.capacity]  # FAULT: one scratch for both families
            small._ptr = small.tensor.data_ptr()


class _SigmaInBf16(LoRAWeights):
    def scalings(self, module: str) -> torch.Tensor:
        # FAULT: σ kept in bf16 (a model's dtype) instead of fp32: α/r = 4/3 etc. lose up to 2⁻⁹.
        return super().scalings(module).to(torch.bfloat16).to(torch.float32)


class SigmaInBf16(_WeightsViewBackend):
    """σ rounded through bf16 (the model's dtype on a GPU) instead of kept in fp32: a σ such as α/r = 4/3
    or α/√r is off by up to 2⁻⁹."""

    name = "mutant-sigma-in-bf16"
    weights_view = _SigmaInBf16


class _SigmaFromHost(LoRAWeights):
    def scalings(self, module: str) -> torch.Tensor:
        device = self.module_scalings.device
        # FAULT: σ from the pool's host copy, as Python numbers: a captured graph keeps capture-time σ.
        return torch.stack([torch.full((), s, dtype=torch.float32, device=device) for s in self.host_scalings[module]])


class SigmaFrozenAtCapture(_WeightsViewBackend):
    """σ passed to the deltas as host numbers (the pool's host copy): right eagerly, but a captured graph
    keeps the σ of capture time, so an adapter loaded into a slot later runs with the old σ."""

    name = "mutant-sigma-frozen-at-capture"
    weights_view = _SigmaFromHost


class WeightsCachedPerSlot(ReferenceBackend):
    """The MoE factors are cached on first use and never invalidated: an adapter loaded into a slot
    later (slot reuse, eviction) runs with the old adapter's weights."""

    name = "mutant-weights-cached-per-slot"

    def _moe_factors(self, weights, module):
        cache = self.__dict__.setdefault("_factor_cache", {})
        if (id(weights), module) not in cache:  # FAULT: no invalidation when load_slot rewrites the pool
            cache[id(weights), module] = tuple(t.clone() for t in super()._moe_factors(weights, module))
        return cache[id(weights), module]


class PairIndexCachedPerInfo(ReferenceBackend):
    """Eager: the (slot, expert) pair index is computed once per batch info and reused by every MoE
    layer's delta calls, but each layer has its own routing: layer 2 gets its LoRA at layer 1's experts."""

    name = "mutant-pair-index-cached-per-info"

    def _pair_index(self, topk_ids, info):
        cached = self.__dict__.get("_pairs")
        if info.use_cuda_graph or cached is None or cached[0] is not info:  # FAULT: keyed on info, not topk_ids
            self._pairs = (info, super()._pair_index(topk_ids, info))
        return self._pairs[1]


class DenseOutAssumedContiguous(ReferenceBackend):
    """``dense_delta`` adds into ``out.contiguous()``: right for a contiguous output, but when ``out`` is a
    column slice of a fused q|k|v output (a strided view, as engines pass it) the delta goes to a copy
    and is lost."""

    name = "mutant-dense-out-assumed-contiguous"

    def dense_delta(self, module, x, out, weights, info):
        super().dense_delta(module, x, out.contiguous(), weights, info)  # FAULT: a copy of a strided out


class ExpertIdEOffByOne(ReferenceBackend):
    """The upper bound of a LoRA expert id is off by one (``id <= E``): a fused shared expert's id of
    exactly E reads the LoRA of the next slot's first expert through the flat ``[L·E]`` expert index
    (sgl-project/sglang's shared-expert-fusion out-of-bounds read); ids past E are still refused."""

    name = "mutant-expert-id-E-off-by-one"

    def _pair_index(self, topk_ids: torch.Tensor, info: LoRABatchInfo):
        if self.spec.virtual_experts:
            return super()._pair_index(topk_ids, info)
        L, E = self.spec.max_loras, self.spec.E
        slot = info.token_lora_mapping.long()[:, None].expand_as(topk_ids)
        ids = topk_ids.long()
        valid = (slot >= 0) & (slot < L) & (ids >= 0) & (ids <= E)  # FAULT: <= E where ids < E
        flat = torch.where(valid, slot * E + ids, torch.zeros_like(ids)) % (L * E)  # a flat read past slot s
        return valid, (flat // E, flat % E), flat // E


class FoldsSigmaIntoPool(ReferenceBackend):
    """σ is folded into the pool's own B at every MoE delta call (B ← σ·B, σ ← 1, in place): the
    outputs stay right, but the backend writes the pool it was handed, which every other reader of
    the pool (another backend, the engine's other layers, an oracle) then sees rescaled."""

    name = "mutant-folds-sigma-into-pool"

    def _fold(self, weights: LoRAWeights, modules: tuple[str, ...]) -> None:
        for module in modules:
            _, B = weights.stored_factors(module)  # as stored (a shared B is one tensor per slot)
            sigma = weights.scalings(module)  # a view of module_scalings
            live = sigma != 0
            factor = torch.where(live, sigma, torch.ones_like(sigma)).to(B.dtype)
            B.mul_(factor.reshape(-1, *([1] * (B.dim() - 1))))  # FAULT: the pool's B, in place
            sigma.copy_(torch.where(live, torch.ones_like(sigma), sigma))

    def moe_gate_up_delta(self, x, topk_ids, gate_up_out, weights, info):
        self._fold(weights, ("gate", "up"))
        super().moe_gate_up_delta(x, topk_ids, gate_up_out, weights, info)

    def moe_down_delta(self, h, topk_ids, topk_weights, down_out, weights, info):
        self._fold(weights, ("down",))
        super().moe_down_delta(h, topk_ids, topk_weights, down_out, weights, info)


_POOL_LOAD_SLOT = LoRAWeights.load_slot
_PARSE_ADAPTER_CONFIG = peft_config.parse_adapter_config
_READ_ADAPTER = checkpoint.read_adapter


class _QuantizedShrinkDeltas:
    """A reference backend's MoE deltas whose gate_up shrink reads x quantized to fp8 codes."""

    def __init__(self, deltas, block_k: int):
        self.deltas, self.block_k = deltas, block_k

    def gate_up(self, x, topk_ids, gate_up_out):
        from moelora_reference.fp8_block import quantize_activation

        codes = quantize_activation(x, self.block_k)[0].to(x.dtype)
        # FAULT: the shrink reads the base GEMM's fp8-quantized activations (the codes, without their
        # scale) instead of the unquantized x (vLLM #42007 / #42120: deltas 50-500x off).
        self.deltas.gate_up(codes, topk_ids, gate_up_out)

    def down(self, h, topk_ids, topk_weights, down_out):
        self.deltas.down(h, topk_ids, topk_weights, down_out)


class QuantizedShrinkOnFp8(ReferenceBackend):
    """``moe_forward`` on an fp8 block-scaled base feeds the LoRA shrink the quantized activations the
    base GEMM reads (the fp8 codes) instead of the unquantized x."""

    name = "mutant-fp8-quantized-shrink"

    def moe_forward(self, x, topk_ids, topk_weights, base_weights, weights, info):
        if base_weights.weight_block is None:
            return super().moe_forward(x, topk_ids, topk_weights, base_weights, weights, info)
        from moelora_core.moe_deltas import BackendMoEDeltas
        from moelora_reference import base_moe

        deltas = _QuantizedShrinkDeltas(BackendMoEDeltas(self, weights, info), base_weights.weight_block[1])
        return base_moe.moe_forward(x, topk_ids, topk_weights, base_weights, deltas=deltas)


class SkipsDeltasOnFp8(ReferenceBackend):
    """``moe_forward`` on an fp8 block-scaled base runs the quantized base alone: the expert deltas are
    loaded but never executed on that path (a vLLM fork's W4A16 experts consumed none of them)."""

    name = "mutant-fp8-skips-deltas"

    def moe_forward(self, x, topk_ids, topk_weights, base_weights, weights, info):
        if base_weights.weight_block is not None:
            from moelora_reference import base_moe

            # FAULT: the quantized path takes no deltas.
            return base_moe.moe_forward(x, topk_ids, topk_weights, base_weights)
        return super().moe_forward(x, topk_ids, topk_weights, base_weights, weights, info)


def _load_slot_keeping_absent_modules(self: LoRAWeights, slot: int, adapter, *, adapter_scaling=None) -> None:
    kept = {}
    for module in (*("gate", "up", "down"), *self.spec.dense_shapes):
        if module not in adapter and self.host_ranks[module][slot]:
            A, B = self.stored_factors(module)  # as stored: a shared factor is written back once
            kept[module] = (A[slot].clone(), B[slot].clone(), self.host_ranks[module][slot],
                            self.host_scalings[module][slot])
    _POOL_LOAD_SLOT(self, slot, adapter, adapter_scaling=adapter_scaling)
    for module, (a, b, r, sigma) in kept.items():  # FAULT: the previous adapter's module is put back
        A, B = self.stored_factors(module)
        A[slot].copy_(a)
        B[slot].copy_(b)
        self.module_ranks[module_index(module), slot] = r
        self.module_scalings[module_index(module), slot] = sigma
        self.host_ranks[module][slot], self.host_scalings[module][slot] = r, sigma


class PoolKeepsStaleModules(ReferenceBackend):
    """The pool keeps a previous adapter's modules in a reused slot: ``load_slot`` of an adapter that
    lacks a module the slot's previous adapter had leaves that module's factors, rank and σ in place
    (the fault is in the pool, put in by this backend's factory; the backend itself is right)."""

    name = "mutant-pool-keeps-stale-modules"

    def __init__(self, spec):
        LoRAWeights.load_slot = _load_slot_keeping_absent_modules  # FAULT: the process's pool class
        super().__init__(spec)


def _parse_dropping_rslora(raw, **kwargs):
    # FAULT: the reader drops use_rslora while parsing adapter_config.json: σ = α/r for an rsLoRA file
    return _PARSE_ADAPTER_CONFIG({k: v for k, v in raw.items() if k != "use_rslora"}, **kwargs)


class ReaderDropsRsLoRA(ReferenceBackend):
    """The adapter reader drops the rsLoRA flag while parsing ``adapter_config.json`` (σ = α/r where the
    file asks α/√r; the fault is in the reader, put in by this backend's factory: a run whose adapters
    never pass through the reader cannot see it)."""

    name = "mutant-reader-drops-rslora"

    def __init__(self, spec):
        peft_config.parse_adapter_config = _parse_dropping_rslora  # FAULT: the process's reader
        super().__init__(spec)


class SlotHookSkippedOnSameConfig(ReferenceBackend):
    """The backend serves the MoE factors from its own copy, refreshed by its slot-load hook — which
    returns early when the slot's ranks and σ are those it last copied: a reload of new weights with
    the same config (RL weight sync, ``load_adapter_from_tensors``) keeps serving the old weights."""

    name = "mutant-slot-hook-skipped-on-same-config"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), slot_load_hook=True)

    @staticmethod
    def _config(weights, slot):
        return tuple((m, weights.host_ranks[m][slot], weights.host_scalings[m][slot])
                     for m in sorted(weights.host_ranks))

    def on_slot_loaded(self, slot, weights):
        copies = self.__dict__.setdefault("_copies", {})
        if id(weights) not in copies:  # first sight of this pool: copy all of it
            copies[id(weights)] = ({m: tuple(t.clone() for t in weights.factors(m)) for m in ("gate", "up", "down")},
                                   {s: self._config(weights, s) for s in range(weights.spec.max_loras)})
            return
        factors, configs = copies[id(weights)]
        if configs[slot] == self._config(weights, slot):
            return  # FAULT: same ranks and σ taken for the same weights; the copy is not refreshed
        for m, (A, B) in factors.items():
            src_A, src_B = weights.factors(m)
            A[slot].copy_(src_A[slot])
            B[slot].copy_(src_B[slot])
        configs[slot] = self._config(weights, slot)

    def _moe_factors(self, weights, module):
        copies = self.__dict__.get("_copies", {})
        return copies[id(weights)][0][module] if id(weights) in copies else super()._moe_factors(weights, module)


def _read_adapter_with_layer_zero_sigma(*args, **kwargs):
    adapter = _READ_ADAPTER(*args, **kwargs)
    first = adapter.layers[0] if adapter.layers else {}
    # FAULT: every layer's module takes layer 0's σ (right unless a rank_pattern / alpha_pattern key
    # names a layer)
    return dataclasses.replace(adapter, layers=tuple(
        {m: dataclasses.replace(lora, scaling=first[m].scaling) if m in first else lora for m, lora in layer.items()}
        for layer in adapter.layers))


class ReaderLayerZeroSigma(ReferenceBackend):
    """The adapter reader gives every layer's module layer 0's σ: right for adapters whose patterns
    name module leaves only, wrong for a layer-specific ``rank_pattern`` / ``alpha_pattern`` key
    (``layers.1.mlp.experts.down_proj``; the fault is in the reader, put in by this backend's factory)."""

    name = "mutant-reader-layer-zero-sigma"

    def __init__(self, spec):
        checkpoint.read_adapter = _read_adapter_with_layer_zero_sigma  # FAULT: the process's reader
        super().__init__(spec)


#: Mutation name → (backend class, what the fault is).
MUTANTS: dict[str, type[ReferenceBackend]] = {
    "stale-tail": StaleTail,
    "base-to-slot-0": BaseToSlotZero,
    "up-uses-gate-A": UpUsesGateA,
    "alpha-over-r": AlphaOverR,
    "sentinel-to-other-adapter": SentinelToOtherAdapter,
    "host-sync": HostSync,
    "32-request-cap": RequestCap32,
    "shared-scratch": SharedScratch,
    "weights-cached-per-slot": WeightsCachedPerSlot,
    "sigma-frozen-at-capture": SigmaFrozenAtCapture,
    "sigma-in-bf16": SigmaInBf16,
    "pair-index-cached-per-info": PairIndexCachedPerInfo,
    "dense-out-assumed-contiguous": DenseOutAssumedContiguous,
    "expert-id-E-off-by-one": ExpertIdEOffByOne,
    "folds-sigma-into-pool": FoldsSigmaIntoPool,
    "pool-keeps-stale-modules": PoolKeepsStaleModules,
    "fp8-quantized-shrink": QuantizedShrinkOnFp8,
    "fp8-skips-deltas": SkipsDeltasOnFp8,
    "reader-drops-rslora": ReaderDropsRsLoRA,
    "reader-layer-zero-sigma": ReaderLayerZeroSigma,
    "slot-hook-skipped-on-same-config": SlotHookSkippedOnSameConfig,
    "layer-hot-slot-frozen-at-capture": HotSlotFrozenAtCapture,  # the e2e mutant, in the layer campaign
}
