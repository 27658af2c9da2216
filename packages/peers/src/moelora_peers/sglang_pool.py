"""SGLang 0.5.23's LoRA weight layout: a private copy of moelora's pool, re-packed at slot load.

What ``LoRAMemoryPool.load_lora_weight_to_buffer`` (sglang/srt/lora/mem_pool.py) writes for a MoE
layer, per slot (L slots, E experts, R the pool's max rank, each adapter zero-padded to R):

- ``gate_up_a`` [L, E, 2R, H]: gate A in rows ``[0, R)``, up A in rows ``[R, 2R)`` ("max_rank-spaced
  positions so the kernel's [:max_r] / [max_r:2*max_r] slicing is correct");
- ``gate_up_b`` [L, E, 2I, R]: gate B in rows ``[0, I)``, up B in ``[I, 2I)``, **σ folded in**
  (``w = w * lora_adapter.scaling``, in the weight's dtype, before the copy);
- ``down_a`` [L, E, R, I]; ``down_b`` [L, E, H, R], σ folded in likewise;
- dense modules: ``A`` [L, R, in], ``B`` [L, out, R], σ *not* folded: the csgmv expand kernel
  multiplies by ``scalings[slot]`` at run time.

SGLang folds one σ per adapter (``lora_alpha / r`` of the adapter config: 0.5.23 reads no
rank_pattern / alpha_pattern); moelora's pool carries one σ per module: the copy folds each module's
own σ, which is what SGLang's fold computes for an adapter without patterns, so the kernels are
tested on what the adapter file means (conformance/docs/peers.md, "σ per module").

Expert layouts: "per_expert" only here (SGLang's ``experts_shared_outer_loras`` stores
``gate_up_a`` / ``down_b`` with expert dim 1; the paths do not declare ``shared_expert_factors``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_core.graphs import mark_host_memory
from moelora_core.layer_spec import DENSE_LORA_MODULES, LoRALayerSpec
from moelora_core.weights import LoRAWeights


@dataclass
class SGLangLayerBuffers:
    """One MoE layer's buffers in SGLang's layout (module docstring), in the spec's dtype."""

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    dense_a: dict[str, torch.Tensor]
    dense_b: dict[str, torch.Tensor]


class SGLangPool:
    """The private SGLang-layout copies of every pool a backend has been handed (keyed by pool).

    Args:
        spec: the layer spec (sizes, dtype, device).
        fold_dense: fold σ into the dense B too (vLLM's layout: ``LoRALayerWeights.optimize()`` folds
            every module's σ and the punica kernels run with scale 1.0); SGLang's dense B is unfolded.
    """

    def __init__(self, spec: LoRALayerSpec, fold_dense: bool = False) -> None:
        self.spec = spec
        self.fold_dense = fold_dense
        self._copies: dict[int, SGLangLayerBuffers] = {}
        # The expand kernel's slice offsets per dense module ([0, out]), made once as SGLang's layers
        # make ``output_offset`` and ``output_offset_cpu`` at init (no host-to-device copy per call).
        # The host copy is read with ``.tolist()`` inside the kernel wrapper; on a CPU machine it is
        # registered as host memory so moelora's graph emulator knows it is not device data.
        self._offsets = {m: mark_host_memory(torch.tensor([0, shape[1]], dtype=torch.int32))
                         for m, shape in spec.dense_shapes.items()}
        self._offsets_dev = {m: t.clone().to(spec.device) for m, t in self._offsets.items()}

    def slice_offsets_cpu(self, module: str) -> torch.Tensor:
        """[2] int32 on the host (SGLang's ``output_offset_cpu``)."""
        return self._offsets[module]

    def slice_offsets(self, module: str) -> torch.Tensor:
        """[2] int32 on the device: the expand kernel's slice boundaries of dense ``module``."""
        return self._offsets_dev[module]

    def _allocate(self) -> SGLangLayerBuffers:
        s = self.spec
        L, E, R, H, I = s.max_loras, s.E, s.R, s.H, s.I  # noqa: E741

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=s.dtype, device=s.device)

        dense = [m for m in DENSE_LORA_MODULES if m in s.dense_shapes]
        return SGLangLayerBuffers(
            gate_up_a=z(L, E, 2 * R, H), gate_up_b=z(L, E, 2 * I, R), down_a=z(L, E, R, I), down_b=z(L, E, H, R),
            dense_a={m: z(L, R, s.dense_shapes[m][0]) for m in dense},
            dense_b={m: z(L, s.dense_shapes[m][1], R) for m in dense},
        )

    def buffers(self, weights: LoRAWeights) -> SGLangLayerBuffers:
        """The copy of ``weights`` (built, every slot re-packed, on first use)."""
        mine = self._copies.get(id(weights))
        if mine is None:
            mine = self._copies[id(weights)] = self._allocate()
            for slot in range(self.spec.max_loras):
                self._pack(mine, slot, weights)
        return mine

    def on_slot_loaded(self, slot: int, weights: LoRAWeights) -> None:
        """Re-pack ``slot`` (in place: graphs captured on these buffers read the new adapter)."""
        mine = self._copies.get(id(weights))
        if mine is None:
            self.buffers(weights)
        else:
            self._pack(mine, slot, weights)

    def _pack(self, mine: SGLangLayerBuffers, slot: int, weights: LoRAWeights) -> None:
        dt, R, I = self.spec.dtype, self.spec.R, self.spec.I  # noqa: E741

        def folded(module: str) -> torch.Tensor:
            # SGLang: ``w = w * lora_adapter.scaling`` in the weight's dtype, then the buffer copy.
            B = weights.factors(module)[1][slot].to(dt)
            return B * weights.scalings(module)[slot].to(dt)

        for i, module in enumerate(("gate", "up")):
            A = weights.factors(module)[0][slot]
            mine.gate_up_a[slot, :, i * R:(i + 1) * R].copy_(A.expand(self.spec.E, *A.shape[-2:]))
            mine.gate_up_b[slot, :, i * I:(i + 1) * I].copy_(folded(module).expand(self.spec.E, I, R))
        mine.down_a[slot].copy_(weights.factors("down")[0][slot].expand_as(mine.down_a[slot]))
        mine.down_b[slot].copy_(folded("down").expand_as(mine.down_b[slot]))
        for m in mine.dense_a:
            mine.dense_a[m][slot].copy_(weights.factors(m)[0][slot])
            mine.dense_b[m][slot].copy_(folded(m) if self.fold_dense else weights.factors(m)[1][slot])
