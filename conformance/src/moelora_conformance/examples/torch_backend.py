"""A small torch backend written the way production backends write theirs — the suite's model of a
third-party backend, which passes every property (``tests/test_suite_examples.py``).

    pytest -p moelora_conformance.plugin --backend moelora_conformance.examples.torch_backend:make_backend

What makes it "production-style" (each a habit the suite once raised false alarms on):

- **Host metadata as engines stage it**: host lists become tensors with ``device="cpu"`` (pinned
  where CUDA is) and reach the device with ``.to(device, non_blocking=True)`` (eager) or
  ``static[:n].copy_(host, non_blocking=True)`` (graph families, tails reset on the device).
- **One buffer set per graph family**: ``init_graph`` allocates the family's buffers once, at its
  largest bucket; ``prepare(batch, family, bucket)`` writes the views ``[:n]`` of the bucket's
  capacity and resets their tails, so every bucket's graph reads the same memory.
- **σ folded once, into its own copy**: the slot-load hook (``on_slot_loaded``, capability
  ``slot_load_hook``) copies the slot's A and σ·B (fp32) into the backend's private stacks, in
  place, so graphs captured earlier see the new adapter; the pool is never written. An engine holds
  one instance, so one copy.
- **Rounding as fused MoE-LoRA kernels do**: the shrink output ``A x`` and the delta ``σ·B(A x)``
  are rounded to the activation dtype before the delta is added (vLLM's fused_moe_lora kernels
  keep both in fp16 / bf16).
- **One alignment per layer** (capability ``shared_moe_alignment``): ``moe_align`` builds the
  (slot, expert) pair index once and both delta calls of the layer take it as ``align=``.
- **Private metadata** (``LoRABatchInfo.private``): the token → slot index as int64, a static
  buffer of its own in graph families.

Math: DESIGN.md §1; each delta is a gather of the pair's factors and two batched mat-vecs. A pair
whose token has no adapter, whose slot has rank 0 for the module, or whose expert id is < 0 or >= E
adds nothing: outputs are merged with ``torch.where``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moelora_core.backend_checks import (
    GraphCapacity,
    check_batch,
    check_bucket,
    check_capacity,
    initialised_family,
    needs_allocation,
)
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities, Fallback
from moelora_core.layer_spec import DENSE_MODULES, MOE_MODULES, LoRALayerSpec
from moelora_core.weights import LoRAWeights, module_index
from moelora_reference.base_moe import gather_matvec

F32, I32, I64 = torch.float32, torch.int32, torch.int64

#: Metadata fields staged from host lists: name → (length kind, tail value on the device).
_FIELDS = {
    "req_seg_indptr": ("req+1", None), "req_weight_indices": ("req", -1), "adapter_enabled": ("slots", 0),
    "token_lora_mapping": ("tok", -1),
}


@dataclass
class _Family:
    capacity: GraphCapacity
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _PrivatePool:
    """The backend's own copy of one pool: A and σ·B per module (fp32), and per-module ranks."""

    A: dict[str, torch.Tensor]
    B: dict[str, torch.Tensor]
    ranks: torch.Tensor  # [modules, L] int32


@dataclass(frozen=True)
class PairIndex:
    """One layer's (slot, expert) index of every (token, k) pair: what ``moe_align`` shares."""

    valid: torch.Tensor  # [T, k] bool
    slot: torch.Tensor  # [T, k] int64 (0 where invalid)
    expert: torch.Tensor  # [T, k] int64 (0 where invalid)


class TorchBackend:
    """The production-style torch backend (module docstring). ``moelora_core.Backend``."""

    name = "production-torch"
    version = "0.1.0"

    def __init__(self, spec: LoRALayerSpec) -> None:
        self.spec = spec
        self._families: dict[str, _Family] = {}
        self._private: dict[int, _PrivatePool] = {}
        self._pin = torch.cuda.is_available()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}), devices=frozenset({"cpu", "cuda"}),
            graph_families=frozenset({"decode", "prefill"}), prefill_graph_modes=frozenset({"full", "breakable"}),
            shared_moe_alignment=True, slot_load_hook=True,
        )

    # --- the private copy of the pool ------------------------------------------------------------

    def _private_of(self, weights: LoRAWeights) -> _PrivatePool:
        mine = self._private.get(id(weights))
        if mine is None:
            modules = (*MOE_MODULES, *(m for m in DENSE_MODULES if m in self.spec.dense_shapes))
            A = {m: torch.zeros(weights.factors(m)[0].shape, dtype=F32, device=self.spec.device) for m in modules}
            B = {m: torch.zeros(weights.factors(m)[1].shape, dtype=F32, device=self.spec.device) for m in modules}
            mine = _PrivatePool(A, B, torch.zeros_like(weights.module_ranks))
            self._private[id(weights)] = mine
            for slot in range(self.spec.max_loras):
                self.on_slot_loaded(slot, weights)
        return mine

    def on_slot_loaded(self, slot: int, weights: LoRAWeights) -> None:
        """Copy ``slot`` of ``weights`` into the private stacks, σ folded into B (in place: captured
        graphs read the same storage)."""
        mine = self._private.get(id(weights))
        if mine is None:
            self._private_of(weights)  # builds the copy of every slot, this one included
            return
        for m in mine.A:
            A, B = weights.factors(m)
            sigma = weights.scalings(m)[slot].to(F32)
            mine.A[m][slot].copy_(A[slot].to(F32))
            mine.B[m][slot].copy_(B[slot].to(F32) * sigma)
        mine.ranks[:, slot].copy_(weights.module_ranks[:, slot])

    # --- graph families and prepare ---------------------------------------------------------------

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        check_capacity(family, capacity)
        existing = self._families.get(family)
        if not needs_allocation(existing.capacity if existing else None, capacity, family):
            return
        dev = self.spec.device
        fam = _Family(capacity)
        for f, n in self._sizes(capacity.max_requests, capacity.max_tokens).items():
            fam.buffers[f] = torch.zeros(n, dtype=I32, device=dev)
        fam.buffers["token_slot"] = torch.zeros(capacity.max_tokens, dtype=I64, device=dev)
        self._families[family] = fam

    def _sizes(self, requests: int, tokens: int) -> dict[str, int]:
        per = {"req+1": requests + 1, "req": requests, "slots": self.spec.max_loras, "tok": tokens}
        return {name: per[kind] for name, (kind, _) in _FIELDS.items()}

    def _host(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=self._pin)

    def prepare(self, batch: BatchSpec, family: str | None = None,
                bucket: GraphCapacity | None = None) -> LoRABatchInfo | Fallback:
        check_batch(batch, self.spec)
        lists = {"req_seg_indptr": list(batch.req_seg_indptr), "req_weight_indices": list(batch.req_weight_indices),
                 "adapter_enabled": list(batch.adapter_enabled), "token_lora_mapping": list(batch.token_lora_mapping)}
        dev = self.spec.device
        if family is None:
            t = {f: self._host(v, I32).to(dev, non_blocking=True) for f, v in lists.items()}
            t["token_slot"] = t["token_lora_mapping"].clamp(min=0).to(I64)
            return self._info(batch, t, batch.bs, batch.num_tokens, max(batch.seq_lens, default=0), False)
        fam = initialised_family(self._families, family)
        cap = check_bucket(family, fam.capacity, bucket)
        reason = cap.fallback_reason(batch, family)
        if reason is not None:
            return Fallback(reason)
        # the bucket's views of the family's buffers: every bucket reads the same memory
        view = {f: fam.buffers[f][:n] for f, n in self._sizes(cap.max_requests, cap.max_tokens).items()}
        for f, values in lists.items():
            n, tail = len(values), _FIELDS[f][1]
            if n:
                view[f][:n].copy_(self._host(values, I32), non_blocking=True)
            # tails reset on the device, up to the bucket's length: request offsets repeat the last live one
            view[f][n:].fill_(batch.num_tokens if tail is None else tail)
        view["token_slot"] = fam.buffers["token_slot"][: cap.max_tokens]
        view["token_slot"].copy_(view["token_lora_mapping"].clamp(min=0))
        max_len = cap.tokens_per_request if cap.tokens_per_request is not None else cap.max_tokens
        return self._info(batch, view, cap.max_requests, cap.max_tokens, max_len, True)

    def _info(self, batch: BatchSpec, t: dict[str, torch.Tensor], bs: int, tokens: int, max_len: int,
              graph: bool) -> LoRABatchInfo:
        return LoRABatchInfo(
            num_tokens=tokens, req_seg_indptr=t["req_seg_indptr"], req_weight_indices=t["req_weight_indices"],
            token_lora_mapping=t["token_lora_mapping"], adapter_enabled=t["adapter_enabled"], num_segments=bs,
            max_len=max_len, seg_indptr=t["req_seg_indptr"], weight_indices=t["req_weight_indices"],
            permutation=None, has_active_lora=True if graph else batch.has_active_lora, use_cuda_graph=graph,
            private={"token_slot": t["token_slot"]},
        )

    # --- deltas ------------------------------------------------------------------------------------

    def moe_align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> PairIndex:
        """The layer's pair index (shared by its two delta calls)."""
        ids = topk_ids.to(I64)
        token = info.token_lora_mapping[: ids.shape[0], None]
        valid = (token >= 0) & (ids >= 0) & (ids < self.spec.E)
        slot = info.private["token_slot"][: ids.shape[0], None].expand_as(ids)
        return PairIndex(valid, torch.where(valid, slot, 0), torch.where(valid, ids, 0))

    def _delta(self, inp: torch.Tensor, weights: LoRAWeights, module: str, pairs: PairIndex, out_dtype: torch.dtype,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ·B(A inp) [T, k, out], active [T, k]) of one MoE module, rounded where fused MoE-LoRA
        kernels round: the shrink output and the (router-weighted, ``scale``) delta, to ``out_dtype``."""
        mine = self._private_of(weights)
        index = (pairs.slot, pairs.expert)
        shrink = gather_matvec(inp, mine.A[module], index).to(out_dtype).to(F32)  # [T, k, R]
        delta = gather_matvec(shrink, mine.B[module], index)  # [T, k, out] fp32
        if scale is not None:
            delta = delta * scale[..., None]
        rank = mine.ranks[module_index(module)].to(I64)[pairs.slot]
        return delta.to(out_dtype), pairs.valid & (rank > 0)

    def moe_gate_up_delta(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, *, align: PairIndex | None = None) -> None:
        if not info.has_active_lora:
            return
        pairs = align if align is not None else self.moe_align(topk_ids, info)
        T, k = topk_ids.shape
        xs = x[:, None, :].expand(T, k, x.shape[1])
        I = self.spec.I  # noqa: E741
        for module, cols in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
            delta, active = self._delta(xs, weights, module, pairs, x.dtype)
            part = gate_up_out[..., cols]
            part.copy_(torch.where(active[..., None], part + delta.to(part.dtype), part))

    def moe_down_delta(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       down_out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo, *,
                       align: PairIndex | None = None) -> None:
        if not info.has_active_lora:
            return
        pairs = align if align is not None else self.moe_align(topk_ids, info)
        T, k = topk_ids.shape
        # h may come in fp32 (the suite's default): the fused kernels compute in the model dtype
        delta, active = self._delta(h.reshape(T, k, -1), weights, "down", pairs, weights.spec.dtype,
                                    scale=topk_weights.to(F32))
        down_out.copy_(torch.where(active[..., None], down_out + delta.to(down_out.dtype), down_out))

    def dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                    info: LoRABatchInfo) -> None:
        if not info.has_active_lora:
            return
        mine = self._private_of(weights)
        slot = info.private["token_slot"][: x.shape[0], None]  # [T, 1]
        shrink = gather_matvec(x[:, None, :], mine.A[module], (slot,))  # [T, 1, R]
        delta = gather_matvec(shrink, mine.B[module], (slot,))[:, 0]  # [T, out] fp32
        rank = mine.ranks[module_index(module)].to(I64)[slot[:, 0]]
        active = (info.token_lora_mapping[: x.shape[0]] >= 0) & (rank > 0)
        out.copy_(torch.where(active[:, None], (out.to(F32) + delta).to(out.dtype), out))

    def moe_forward(self, x, topk_ids, topk_weights, base_weights: MoEBaseWeights, weights, info):  # pragma: no cover
        raise NotImplementedError("fused_moe is not declared")

    def static_buffers(self, family: str) -> dict[str, torch.Tensor]:
        return dict(initialised_family(self._families, family).buffers)


def make_backend(spec: LoRALayerSpec) -> TorchBackend:
    """``--backend moelora_conformance.examples.torch_backend:make_backend``."""
    return TorchBackend(spec)
