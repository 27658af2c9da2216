"""Who adds the LoRA deltas inside one MoE layer forward (DESIGN.md §5, §6 "One MoE forward").

The MoE sequence — base gate_up GEMM → gate_up delta → activation → down GEMM → down delta →
top-k sum — is written exactly twice: the Triton base path (``moelora_kernels.fused_moe``) and the
torch base path (``moelora_reference.base_moe.moe_forward``). Both take ``deltas=``: an object with
the two methods of :class:`MoEDeltas` (None = the base MoE alone). Everything that runs a MoE
layer with LoRA — the suite's layer harness, the engine, the benchmarks, the backends' tests —
calls one of these two functions with a :class:`MoEDeltas`, and nobody rewrites the sequence.

:class:`BackendMoEDeltas` turns any ``Backend`` + ``LoRAWeights`` + ``LoRABatchInfo`` into one.
It lives for one layer forward: where the backend declares ``shared_moe_alignment`` it computes
the backend's MoE alignment once, at the gate_up call, and hands it to the down call of the same
layer (safe, because the object dies with the layer forward; nothing is keyed by a tensor that an
engine rewrites in place). :func:`moe_layer_forward` is the one dispatch between a backend that
declares ``fused_moe`` (its own ``moe_forward``) and a base path with the backend's deltas.

Shapes: T tokens, k = top_k, H hidden, I intermediate. ``gate_up_out`` [T, k, 2I] (gate columns
[:I], up [I:]), ``h`` [T·k, I] (row t·k + j for pair (t, j)), ``down_out`` [T, k, H] router-weighted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.weights import LoRAWeights


@runtime_checkable
class MoEDeltas(Protocol):
    """The two points where LoRA enters a MoE layer (DESIGN.md §1).

    Both add in place and must leave every (token, k) pair without an adapter bit-identical.
    """

    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor) -> None:
        """Add σ·B_gate(A_gate x) into ``gate_up_out[..., :I]`` and σ·B_up(A_up x) into ``[..., I:]``.

        Args:
            x: [T, H] the layer input. topk_ids: [T, k] int expert ids.
            gate_up_out: [T, k, 2I] base gate/up output, before the activation.
        """
        ...

    def down(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             down_out: torch.Tensor) -> None:
        """Add w_k·σ·B_down(A_down h) into ``down_out`` [T, k, H].

        Args:
            h: [T·k, I] activated intermediate. topk_weights: [T, k] router weights.
        """
        ...


_NOT_ALIGNED = object()


class BackendMoEDeltas:
    """A backend's MoE deltas for one layer forward: ``Backend`` + pool + batch info → :class:`MoEDeltas`.

    Args:
        backend: any object following ``moelora_core.Backend``.
        weights: the layer's adapter pool (read-only to the backend).
        info: the batch's metadata from ``backend.prepare``.

    Where ``backend.capabilities().shared_moe_alignment`` is True, the alignment made by
    ``backend.moe_align(topk_ids, info)`` at the gate_up call is passed as ``align=`` to both delta
    calls of this layer; otherwise each delta call aligns on its own.
    """

    def __init__(self, backend: Any, weights: LoRAWeights, info: LoRABatchInfo) -> None:
        self.backend = backend
        self.weights = weights
        self.info = info
        self._shared = bool(getattr(backend.capabilities(), "shared_moe_alignment", False))
        self._align: object = _NOT_ALIGNED

    def _alignment(self, topk_ids: torch.Tensor) -> dict[str, object]:
        if not self._shared:
            return {}
        if self._align is _NOT_ALIGNED:
            # The backend's alignment (None where it has nothing to align: no active adapter or no
            # token, so its delta calls launch nothing either).
            self._align = self.backend.moe_align(topk_ids, self.info)
        return {"align": self._align}

    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor, gate_up_out: torch.Tensor) -> None:
        self.backend.moe_gate_up_delta(x, topk_ids, gate_up_out, self.weights, self.info,
                                       **self._alignment(topk_ids))

    def down(self, h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             down_out: torch.Tensor) -> None:
        self.backend.moe_down_delta(h, topk_ids, topk_weights, down_out, self.weights, self.info,
                                    **self._alignment(topk_ids))


#: A base MoE path: ``(x, topk_ids, topk_weights, base, *, deltas) -> y [T, H]``.
BaseMoEPath = Callable[..., torch.Tensor]


def moe_layer_forward(base_path: BaseMoEPath, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, base: MoEBaseWeights, backend: Any | None,
                      weights: LoRAWeights | None, info: LoRABatchInfo | None, **base_kwargs: Any) -> torch.Tensor:
    """One MoE layer with a backend's LoRA: its own ``moe_forward`` where it declares ``fused_moe``,
    else ``base_path`` with :class:`BackendMoEDeltas`; the base MoE alone when ``info`` is None.

    Args:
        base_path: ``moelora_reference.base_moe.moe_forward`` or a wrapper of
            ``moelora_kernels.fused_moe`` with the signature of :data:`BaseMoEPath`.
        x: [T, H]. topk_ids: [T, k] int. topk_weights: [T, k] router weights.
        base: the layer's base expert weights.
        backend, weights, info: the backend, the layer's pool and the batch metadata; ``info``
            None runs no LoRA at all (a fused backend is not called then either).
        base_kwargs: passed to ``base_path`` (e.g. ``intermediate_dtype``); ignored on the fused path.

    Returns:
        y [T, H] as ``base_path`` (or the backend's ``moe_forward``) returns it.
    """
    if info is None or backend is None:
        return base_path(x, topk_ids, topk_weights, base, deltas=None, **base_kwargs)
    if backend.capabilities().fused_moe:
        return backend.moe_forward(x, topk_ids, topk_weights, base, weights, info)
    return base_path(x, topk_ids, topk_weights, base, deltas=BackendMoEDeltas(backend, weights, info), **base_kwargs)
