"""The reference backend: the ``Backend`` protocol in vectorised, graph-safe torch (DESIGN.md §5).

Built by :func:`make_backend` (the built-in name ``reference``). It declares every capability and
is checked against the readable oracle; third-party backends are checked against the same suite.

Metadata (``prepare``): one segment per request (the backend segments are the request segments
themselves, no permutation), staged from the ``BatchSpec``'s host lists by the metadata machinery
every built-in backend shares (:mod:`moelora_core.metadata`, through
:class:`moelora_core.backend_base.BackendBase`): pinned staging into fresh tensors sized to the batch
(eager) or in place into views of a graph family's ``StaticBuffer``s with tails reset (graph); the
token map is written on the device from the request segments
(:func:`moelora_core.metadata.map_tokens_torch`). Over capacity returns ``Fallback`` before any
write. The argument checks (batch, graph-family capacities and
``Fallback`` reasons, delta shapes) are those of :mod:`moelora_core.backend_checks`.

Deltas: for every (token, k) pair, gather the slot's and expert's A and B and run two batched
mat-vecs (:func:`moelora_reference.base_moe.gather_matvec`), in fp32, σ from
``LoRAWeights.module_scalings`` at run time. A pair adds nothing — its output stays bit-identical —
when its token maps to -1, its slot is disabled or has rank 0 for the module, or its expert id is
< 0 or >= E: results are merged with ``torch.where``, never by adding a zero. Each output element
is rounded once (old value + delta in fp32).

With ``spec.virtual_experts`` the MoE deltas go through virtual expert ids: (slot, expert) →
``slot * E + expert`` (sentinels → -1), read back as ``(v // E, v % E)`` in the ``[L, E, ...]``
views, a second, independent indexing of the same math (a factor the spec's ``expert_layout``
stores once per slot is read with expert stride 0 either way, never copied E times).

No host synchronisation in the delta calls: only host shapes and ``info``'s host fields steer
Python; device values are only ever used by device ops.
"""

from __future__ import annotations

import torch

from moelora_core.backend_base import BackendBase
from moelora_core.backend_checks import GraphCapacity
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.metadata import LaunchSizes, Segmentation
from moelora_core.moe_deltas import BackendMoEDeltas
from moelora_core.weights import LoRAWeights
from moelora_reference import __version__, base_moe

F32 = torch.float32


class ReferenceBackend(BackendBase):
    """The vectorised torch reference backend for one layer spec (satisfies ``moelora_core.Backend``).

    Args:
        spec: the layer spec (sizes, slots, R, dtype, device, virtual experts).
    """

    name = "reference"
    #: The reference computes in fp32 from weights of any dtype and takes any integer topk_ids.
    weights_same_dtype = False
    topk_id_dtypes = None

    def __init__(self, spec: LoRALayerSpec) -> None:
        super().__init__(spec, __version__)

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
            fused_shared_experts=True,
            shared_expert_factors=True,
            # Its deltas read the activations they are given (never a quantized copy), and moe_forward
            # runs the w8a8 base of base_moe for fp8 experts (DESIGN.md §1, "Quantized base").
            base_quants=frozenset({"none", "fp8_block"}),
        )

    # --- segmentation: one segment per request -------------------------------------------------

    def eager_segmentation(self, batch: BatchSpec) -> Segmentation:
        return Segmentation.per_request(batch)

    def family_layout(self, family: str, capacity: GraphCapacity, family_capacity: GraphCapacity):
        # One segment per request; the longest is a decode request's tokens or the whole capacity.
        tpr = capacity.tokens_per_request
        max_len = tpr if tpr is not None else capacity.max_tokens
        sizes = LaunchSizes(capacity.max_requests, capacity.max_tokens, self.spec.max_loras, capacity.max_requests,
                            max_len, False, request_segments=True)
        return sizes, Segmentation.per_request

    # --- the pair index: (slot, expert) or virtual expert -------------------------------------------

    def _pair_index(self, topk_ids: torch.Tensor, info: LoRABatchInfo):
        """(valid [T, k] bool, index tuple into the [L, E, ...] weights, slot [T, k] long)."""
        L, E = self.spec.max_loras, self.spec.E
        slot = info.token_lora_mapping.long()[:, None].expand_as(topk_ids)
        ids = topk_ids.long()
        if self.spec.virtual_experts:
            virtual = torch.where((slot >= 0) & (slot < L) & (ids >= 0) & (ids < E), slot * E + ids,
                                  torch.full_like(ids, -1))
            valid = virtual >= 0
            v = torch.where(valid, virtual, torch.zeros_like(virtual))
            # v → (v // E, v % E) into the [L, E, ...] views: a factor stored once per slot (expert
            # stride 0) is read in place, where flattening it to [L·E, ...] would copy it E times.
            return valid, (v // E, v % E), v // E
        valid = (slot >= 0) & (slot < L) & (ids >= 0) & (ids < E)
        s = torch.where(valid, slot, torch.zeros_like(slot))
        e = torch.where(valid, ids, torch.zeros_like(ids))
        return valid, (s, e), s

    def _moe_factors(self, weights: LoRAWeights, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return weights.factors(module)

    def _active(self, valid: torch.Tensor, slot: torch.Tensor, weights: LoRAWeights, module: str,
                info: LoRABatchInfo) -> torch.Tensor:
        """valid pairs whose slot is enabled and has this module (rank > 0)."""
        ranks = weights.ranks(module).long()[slot]
        enabled = info.adapter_enabled.long()[slot]
        return valid & (ranks > 0) & (enabled > 0)

    # --- deltas --------------------------------------------------------------------------------

    def compute_moe_delta(self, stage: str, inp: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                          weights: LoRAWeights, info: LoRABatchInfo, topk_weights: torch.Tensor | None,
                          align: object | None) -> None:
        """The ``stage`` delta (arguments checked by ``BackendBase``): gate_up adds σ_gate·B_gate(A_gate x)
        into columns [:I] and σ_up·B_up(A_up x) into [I:] of ``out`` [T, k, 2I]; down adds
        w_k·σ_down·B_down(A_down h) into ``out`` [T, k, H]."""
        if stage == "gate_up":
            self._gate_up_delta(inp, topk_ids, out, weights, info)
        else:
            self._down_delta(inp, topk_ids, topk_weights, out, weights, info)

    def _gate_up_delta(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor,
                       weights: LoRAWeights, info: LoRABatchInfo) -> None:
        T, k = topk_ids.shape
        H, I = self.spec.H, self.spec.I  # noqa: E741
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

    def _down_delta(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    down_out: torch.Tensor, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        T, k = topk_ids.shape
        valid, index, slot = self._pair_index(topk_ids, info)
        A, B = self._moe_factors(weights, "down")
        mid = base_moe.gather_matvec(h.reshape(T, k, self.spec.I), A, index)  # [T, k, R]
        delta = base_moe.gather_matvec(mid, B, index)  # [T, k, H]
        delta = delta * (weights.scalings("down")[slot] * topk_weights.to(F32))[..., None]
        mask = self._active(valid, slot, weights, "down", info)[..., None]
        summed = (down_out.to(F32) + delta).to(down_out.dtype)
        down_out.copy_(torch.where(mask, summed, down_out))

    def compute_dense_delta(self, module: str, x: torch.Tensor, out: torch.Tensor, weights: LoRAWeights,
                            info: LoRABatchInfo) -> None:
        """out [T, out] += σ·B(A x) of dense ``module`` (arguments checked by ``BackendBase``)."""
        L = self.spec.max_loras
        slot = info.token_lora_mapping.long()[:, None]  # [T, 1]
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
            InvalidFieldError: base weights of another shape or ``base_quant`` than the spec.
        """
        if base_weights.num_experts != self.spec.E or base_weights.hidden_size != self.spec.H \
                or base_weights.intermediate_size != self.spec.I:
            raise InvalidFieldError("base_weights", f"(E, H, I) = ({base_weights.num_experts}, "
                                                    f"{base_weights.hidden_size}, {base_weights.intermediate_size}) "
                                                    f"!= the spec's ({self.spec.E}, {self.spec.H}, {self.spec.I})")
        if base_weights.base_quant != self.spec.base_quant:
            raise InvalidFieldError("base_weights", f"base_quant {base_weights.base_quant!r} != the spec's "
                                                    f"{self.spec.base_quant!r}")
        return base_moe.moe_forward(x, topk_ids, topk_weights, base_weights,
                                    deltas=BackendMoEDeltas(self, weights, info))

def make_backend(spec: LoRALayerSpec) -> ReferenceBackend:
    """The factory of the built-in ``reference`` backend (``moelora_reference.backend:make_backend``)."""
    return ReferenceBackend(spec)
