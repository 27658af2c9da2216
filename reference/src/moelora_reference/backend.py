"""The reference backend: the ``Backend`` protocol in vectorised, graph-safe torch (DESIGN.md §5).

Built by :func:`make_backend` (the built-in name ``reference``). It declares every capability and
is checked against the readable oracle; third-party backends are checked against the same suite.

Metadata (``prepare``): one segment per request (``seg_indptr = req_seg_indptr``, ``weight_indices
= req_to_lora``, no permutation), built from the ``BatchSpec``'s host lists only and staged through
``PinnedStaging`` — into fresh tensors sized to the batch (eager) or in place into a graph family's
``StaticBuffer``s with tails reset (graph). Over capacity returns ``Fallback`` before any write.
The argument checks (batch, graph-family capacities and ``Fallback`` reasons, delta shapes) are
those of :mod:`moelora_core.backend_checks`, shared with the kernel backends.

Deltas: for every (token, k) pair, gather the slot's and expert's A and B and run two batched
mat-vecs (:func:`moelora_reference.base_moe.gather_matvec`), in fp32, σ from
``LoRAWeights.module_scalings`` at run time. A pair adds nothing — its output stays bit-identical —
when its token maps to -1, its slot is disabled or has rank 0 for the module, or its expert id is
< 0 or >= E: results are merged with ``torch.where``, never by adding a zero. Each output element
is rounded once (old value + delta in fp32).

With ``spec.virtual_experts`` the MoE deltas go through virtual expert ids: (slot, expert) →
``slot * E + expert`` (sentinels → -1) and the ``[L * E, ...]`` view of the weights, a second,
independent indexing of the same math.

No host synchronisation in the delta calls: only host shapes and ``info``'s host fields steer
Python; device values are only ever used by device ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moelora_core.backend_checks import (
    FamilyCapacity,
    check_batch,
    check_dense_module,
    check_floating,
    check_init_sizes,
    check_shape,
    check_topk_ids,
    check_weights,
    initialised_family,
    needs_allocation,
)
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo, MoELoRABatchInfo
from moelora_core.capabilities import Capabilities, Fallback
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.moe_deltas import BackendMoEDeltas
from moelora_core.staging import PinnedStaging
from moelora_core.static_buffer import StaticBuffer
from moelora_core.weights import LoRAWeights
from moelora_reference import __version__, base_moe

F32 = torch.float32
I32 = torch.int32

#: Integer metadata fields staged per batch, in staging order: (name, length kind, tail fill).
#: Length kinds: "req+1" request offsets, "req" per request, "slots" per slot, "tok" per token.
_INT_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("seg_indptr", "req+1", 0),
    ("seg_lens", "req", 0),
    ("weight_indices", "req", -1),
    ("lora_ranks", "slots", 0),
    ("req_seg_indptr", "req+1", 0),
    ("req_weight_indices", "req", -1),
    ("moe.seg_indptr", "req+1", 0),
    ("moe.req_to_lora", "req", -1),
    ("moe.adapter_enabled", "slots", 0),
    ("moe.token_lora_mapping", "tok", -1),
)


def _length(kind: str, requests: int, tokens: int, slots: int) -> int:
    return {"req+1": requests + 1, "req": requests, "slots": slots, "tok": tokens}[kind]


def _host_lists(batch: BatchSpec) -> dict[str, list]:
    """Every metadata field of ``batch`` as a host list (live entries only)."""
    indptr = list(batch.req_seg_indptr)
    slots = list(batch.req_to_lora)
    return {
        "seg_indptr": indptr,
        "seg_lens": list(batch.seq_lens),
        "weight_indices": slots,
        "lora_ranks": list(batch.lora_ranks),
        "scalings": list(batch.scalings),
        "req_seg_indptr": indptr,
        "req_weight_indices": slots,
        "moe.seg_indptr": indptr,
        "moe.req_to_lora": slots,
        "moe.adapter_enabled": list(batch.adapter_enabled),
        "moe.token_lora_mapping": list(batch.token_lora_mapping),
    }


@dataclass
class _GraphFamily:
    """One graph family's static buffers (capacities fixed at init) and staging."""

    capacity: FamilyCapacity
    buffers: dict[str, StaticBuffer] = field(default_factory=dict)
    int_staging: PinnedStaging | None = None
    float_staging: PinnedStaging | None = None


class ReferenceBackend:
    """The vectorised torch reference backend for one layer spec (satisfies ``moelora_core.Backend``).

    Args:
        spec: the layer spec (sizes, slots, R, dtype, device, virtual experts).
    """

    name = "reference"

    def __init__(self, spec: LoRALayerSpec) -> None:
        if not isinstance(spec, LoRALayerSpec):
            raise InvalidFieldError("spec", f"must be a LoRALayerSpec, got {type(spec).__name__}")
        self.version = __version__
        self.spec = spec
        self._families: dict[str, _GraphFamily] = {}
        self._eager_int = PinnedStaging(0, I32, spec.device)
        self._eager_float = PinnedStaging(spec.max_loras, F32, spec.device)

    # --- capabilities --------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
            devices=frozenset({"cpu", "cuda"}),
            graph_families=frozenset({"decode", "prefill"}),
            prefill_graph_modes=frozenset({"full", "breakable"}),
            virtual_experts=True,
            fused_moe=True,
            max_rank=None,
            max_requests=None,
        )

    # --- graph families --------------------------------------------------------------------------

    def init_decode_graph(self, max_bs: int, tokens_per_request: int = 1) -> None:
        """Allocate the decode family: ``max_bs`` requests of ``tokens_per_request`` tokens.

        Raises:
            InvalidFieldError: a size < 1, or a second call with other capacities.
        """
        self._init_family("decode", max_bs, max_bs * tokens_per_request, tokens_per_request,
                          sizes={"max_bs": max_bs, "tokens_per_request": tokens_per_request})

    def init_prefill_graph(self, max_num_tokens: int, max_num_requests: int) -> None:
        """Allocate the prefill family: up to ``max_num_tokens`` tokens in ``max_num_requests`` requests.

        Raises:
            InvalidFieldError: a size < 1, or a second call with other capacities.
        """
        self._init_family("prefill", max_num_requests, max_num_tokens, None,
                          sizes={"max_num_tokens": max_num_tokens, "max_num_requests": max_num_requests})

    def _init_family(self, name: str, max_requests: int, max_tokens: int, tpr: int | None,
                     sizes: dict[str, int]) -> None:
        check_init_sizes(sizes)
        capacity = FamilyCapacity(name, max_requests, max_tokens, tpr)
        existing = self._families.get(name)
        if not needs_allocation(existing.capacity if existing is not None else None, capacity):
            return  # buffers are allocated once; graphs captured on them stay valid
        L, dev = self.spec.max_loras, self.spec.device
        fam = _GraphFamily(capacity)
        total = 0
        for field_name, kind, fill in _INT_FIELDS:
            n = _length(kind, max_requests, max_tokens, L)
            fam.buffers[field_name] = StaticBuffer(f"{name}.{field_name}", n, dtype=I32, device=dev, fill=fill)
            total += n
        fam.buffers["scalings"] = StaticBuffer(f"{name}.scalings", L, dtype=F32, device=dev, fill=0.0)
        fam.int_staging = PinnedStaging(total, I32, dev)
        fam.float_staging = PinnedStaging(L, F32, dev)
        self._families[name] = fam

    # --- prepare -------------------------------------------------------------------------------

    def prepare(self, batch: BatchSpec, family: str | None = None) -> LoRABatchInfo | Fallback:
        """Metadata for ``batch`` from its host lists (no device reads).

        Args:
            batch: the batch.
            family: None (eager: fresh tensors sized to the batch), "decode" or "prefill" (write
                that family's static buffers in place; host numbers in the info are capacities).

        Returns:
            The info, or ``Fallback(reason)`` when the batch exceeds the family's capacity (more
            tokens or requests, a non-DECODE batch or another ``tokens_per_request`` in the decode
            family); nothing was written then.

        Raises:
            InvalidFieldError: another slot count, a rank > R, an unknown or uninitialised family.
        """
        check_batch(batch, self.spec)
        if family is None:
            return self._prepare_eager(batch)
        fam = initialised_family(self._families, family)
        reason = fam.capacity.fallback_reason(batch)
        if reason is not None:
            return Fallback(reason)
        return self._prepare_graph(batch, fam)

    def _prepare_graph(self, batch: BatchSpec, fam: _GraphFamily) -> LoRABatchInfo:
        lists = _host_lists(batch)
        last = batch.num_tokens
        buf = fam.buffers
        with fam.int_staging.batch() as stage:
            for name, kind, _ in _INT_FIELDS:
                # Offsets past the live requests repeat the last live offset: empty segments.
                tail = last if kind == "req+1" else None
                buf[name].write(lists[name], tail_fill=tail, stage=stage)
        with fam.float_staging.batch() as stage:
            buf["scalings"].write(lists["scalings"], stage=stage)
        t = {name: b.tensor for name, b in buf.items()}
        cap = fam.capacity
        max_len = cap.tokens_per_request if cap.tokens_per_request is not None else cap.max_tokens
        return self._info(batch, t, bs=cap.max_requests, num_tokens=cap.max_tokens, max_len=max_len,
                          has_active_lora=True, use_cuda_graph=True)

    def _prepare_eager(self, batch: BatchSpec) -> LoRABatchInfo:
        lists = _host_lists(batch)
        dev, L = self.spec.device, self.spec.max_loras
        sizes = {name: _length(kind, batch.bs, batch.num_tokens, L) for name, kind, _ in _INT_FIELDS}
        needed = sum(sizes.values())
        if needed > self._eager_int.capacity:
            # Grow (geometrically); the old pinned buffers are released by the caching host
            # allocator only after the copies that read them have finished.
            self._eager_int = PinnedStaging(max(needed, 2 * self._eager_int.capacity), I32, dev)
        t: dict[str, torch.Tensor] = {}
        with self._eager_int.batch() as stage:
            for name, _, _ in _INT_FIELDS:
                t[name] = torch.empty(sizes[name], dtype=I32, device=dev)
                stage.copy(lists[name], t[name])
        t["scalings"] = torch.empty(L, dtype=F32, device=dev)
        with self._eager_float.batch() as stage:
            stage.copy(lists["scalings"], t["scalings"])
        return self._info(batch, t, bs=batch.bs, num_tokens=batch.num_tokens, max_len=max(batch.seq_lens, default=0),
                          has_active_lora=batch.has_active_lora, use_cuda_graph=False)

    def _info(self, batch: BatchSpec, t: dict[str, torch.Tensor], *, bs: int, num_tokens: int, max_len: int,
              has_active_lora: bool, use_cuda_graph: bool) -> LoRABatchInfo:
        moe = MoELoRABatchInfo(
            seg_indptr=t["moe.seg_indptr"], req_to_lora=t["moe.req_to_lora"],
            adapter_enabled=t["moe.adapter_enabled"], token_lora_mapping=t["moe.token_lora_mapping"],
            num_experts=self.spec.num_experts, max_loras=self.spec.max_loras,
        )
        return LoRABatchInfo(
            forward_mode=batch.forward_mode, bs=bs, num_tokens=num_tokens, num_segments=bs, max_len=max_len,
            seg_indptr=t["seg_indptr"], seg_lens=t["seg_lens"], weight_indices=t["weight_indices"],
            lora_ranks=t["lora_ranks"], scalings=t["scalings"], permutation=None,
            req_seg_indptr=t["req_seg_indptr"], req_weight_indices=t["req_weight_indices"],
            has_active_lora=has_active_lora, use_cuda_graph=use_cuda_graph, moe=moe,
        )

    # --- argument checks (host shapes only) --------------------------------------------------------

    def _check_moe(self, info: LoRABatchInfo, topk_ids: torch.Tensor, weights: LoRAWeights) -> int:
        # The reference computes in fp32 from weights of any dtype and takes any integer topk_ids.
        check_weights(self.spec, weights, same_dtype=False)
        return check_topk_ids(info, topk_ids, self.spec.top_k)

    # --- the pair index: (slot, expert) or virtual expert -------------------------------------------

    def _pair_index(self, topk_ids: torch.Tensor, info: LoRABatchInfo):
        """(valid [T, k] bool, index tuple into the [L, E, ...] or [L·E, ...] weights, slot [T, k] long)."""
        L, E = self.spec.max_loras, self.spec.E
        slot = info.moe.token_lora_mapping.long()[:, None].expand_as(topk_ids)
        ids = topk_ids.long()
        if self.spec.virtual_experts:
            virtual = torch.where((slot >= 0) & (slot < L) & (ids >= 0) & (ids < E), slot * E + ids,
                                  torch.full_like(ids, -1))
            valid = virtual >= 0
            v = torch.where(valid, virtual, torch.zeros_like(virtual))
            return valid, (v,), v // E
        valid = (slot >= 0) & (slot < L) & (ids >= 0) & (ids < E)
        s = torch.where(valid, slot, torch.zeros_like(slot))
        e = torch.where(valid, ids, torch.zeros_like(ids))
        return valid, (s, e), s

    def _moe_factors(self, weights: LoRAWeights, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        A, B = weights.factors(module)
        if self.spec.virtual_experts:
            L, E = self.spec.max_loras, self.spec.E
            return A.reshape(L * E, *A.shape[2:]), B.reshape(L * E, *B.shape[2:])
        return A, B

    def _active(self, valid: torch.Tensor, slot: torch.Tensor, weights: LoRAWeights, module: str,
                info: LoRABatchInfo) -> torch.Tensor:
        """valid pairs whose slot is enabled and has this module (rank > 0)."""
        ranks = weights.ranks(module).long()[slot]
        enabled = info.moe.adapter_enabled.long()[slot]
        return valid & (ranks > 0) & (enabled > 0)

    # --- deltas --------------------------------------------------------------------------------

    def moe_gate_up_delta(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo) -> None:
        """Add σ_gate·B_gate(A_gate x) into columns [:I] and σ_up·B_up(A_up x) into [I:] of
        ``gate_up_out`` [T, k, 2I] in place (see the protocol).

        Raises:
            InvalidFieldError: shapes that do not match the spec and the info's token count; a
                non-floating ``x`` or ``gate_up_out``.
        """
        T = self._check_moe(info, topk_ids, weights)
        H, I, k = self.spec.H, self.spec.I, self.spec.top_k  # noqa: E741
        check_shape(info, "x", x, (T, H))
        check_shape(info, "gate_up_out", gate_up_out, (T, k, 2 * I))
        check_floating(x=x, gate_up_out=gate_up_out)
        if not info.has_active_lora:
            return
        valid, index, slot = self._pair_index(topk_ids, info)
        xs = x[:, None, :].expand(T, k, H)
        parts, masks = [], []
        for module in ("gate", "up"):
            A, B = self._moe_factors(weights, module)
            mid = base_moe.gather_matvec(xs, A, index)  # [T, k, R]
            delta = base_moe.gather_matvec(mid, B, index)  # [T, k, I]
            parts.append(delta * weights.scalings(module)[slot][..., None])
            masks.append(self._active(valid, slot, weights, module, info)[..., None].expand(T, k, I))
        delta, mask = torch.cat(parts, dim=-1), torch.cat(masks, dim=-1)
        summed = (gate_up_out.to(F32) + delta).to(gate_up_out.dtype)
        gate_up_out.copy_(torch.where(mask, summed, gate_up_out))

    def moe_down_delta(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       down_out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        """Add w_k·σ_down·B_down(A_down h) into ``down_out`` [T, k, H] in place (see the protocol).

        Raises:
            InvalidFieldError: shapes that do not match the spec and the info's token count; a
                non-floating ``h``, ``topk_weights`` or ``down_out``.
        """
        T = self._check_moe(info, topk_ids, weights)
        H, I, k = self.spec.H, self.spec.I, self.spec.top_k  # noqa: E741
        check_shape(info, "h", h, (T * k, I))
        check_shape(info, "topk_weights", topk_weights, (T, k))
        check_shape(info, "down_out", down_out, (T, k, H))
        check_floating(h=h, topk_weights=topk_weights, down_out=down_out)
        if not info.has_active_lora:
            return
        valid, index, slot = self._pair_index(topk_ids, info)
        A, B = self._moe_factors(weights, "down")
        mid = base_moe.gather_matvec(h.reshape(T, k, I), A, index)  # [T, k, R]
        delta = base_moe.gather_matvec(mid, B, index)  # [T, k, H]
        delta = delta * (weights.scalings("down")[slot] * topk_weights.to(F32))[..., None]
        mask = self._active(valid, slot, weights, "down", info)[..., None]
        summed = (down_out.to(F32) + delta).to(down_out.dtype)
        down_out.copy_(torch.where(mask, summed, down_out))

    def dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                    info: LoRABatchInfo) -> None:
        """Add σ·B(A x) of dense ``module`` into ``out`` [T, out] in place.

        Raises:
            InvalidFieldError: a module not in the spec, shapes that do not match, a non-floating
                ``x`` or ``out``.
        """
        check_weights(self.spec, weights, same_dtype=False)
        fin, fout = check_dense_module(self.spec, module)
        T = info.moe.token_lora_mapping.numel()
        check_shape(info, "x", x, (T, fin))
        check_shape(info, "out", out, (T, fout))
        check_floating(x=x, out=out)
        if not info.has_active_lora:
            return
        L = self.spec.max_loras
        slot = info.moe.token_lora_mapping.long()[:, None]  # [T, 1]
        valid = (slot >= 0) & (slot < L)
        s = torch.where(valid, slot, torch.zeros_like(slot))
        A, B = weights.factors(module)
        mid = base_moe.gather_matvec(x[:, None, :], A, (s,))  # [T, 1, R]
        delta = base_moe.gather_matvec(mid, B, (s,))[:, 0] * weights.scalings(module)[s]  # [T, out]
        mask = self._active(valid, s, weights, module, info)
        summed = (out.to(F32) + delta).to(out.dtype)
        out.copy_(torch.where(mask, summed, out))

    # --- fused MoE -------------------------------------------------------------------------------

    def moe_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    base_weights: MoEBaseWeights, weights: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
        """The MoE layer with LoRA: base path of :mod:`moelora_reference.base_moe` and this
        backend's deltas at the same points (before the activation; router-weighted down), with
        fp32 intermediates: y is the only value rounded to x's dtype.

        Returns:
            y [T, H] in x's dtype.

        Raises:
            InvalidFieldError: base weights of another shape than the spec.
        """
        if base_weights.num_experts != self.spec.E or base_weights.hidden_size != self.spec.H \
                or base_weights.intermediate_size != self.spec.I:
            raise InvalidFieldError("base_weights", f"(E, H, I) = ({base_weights.num_experts}, "
                                                    f"{base_weights.hidden_size}, {base_weights.intermediate_size}) "
                                                    f"!= the spec's ({self.spec.E}, {self.spec.H}, {self.spec.I})")
        return base_moe.moe_forward(x, topk_ids, topk_weights, base_weights,
                                    deltas=BackendMoEDeltas(self, weights, info))

    # --- for tests and reports ---------------------------------------------------------------------

    def static_buffers(self, family: str) -> dict[str, torch.Tensor]:
        """The family's static buffers by name (to check addresses, tails and untouched fallbacks).

        Raises:
            InvalidFieldError: the family is not initialised.
        """
        return {name: b.tensor for name, b in initialised_family(self._families, family).buffers.items()}


def make_backend(spec: LoRALayerSpec) -> ReferenceBackend:
    """The factory of the built-in ``reference`` backend (``moelora_reference.backend:make_backend``)."""
    return ReferenceBackend(spec)
