"""Each rank's slice of the base weights and of every LoRA factor (the layouts of :mod:`.layout`).

LoRA factors are sharded the way SGLang and vLLM shard them by default (vLLM without
``fully_sharded_loras``), so the deltas need no collective of their own:

=================  =====================  ==========================  ==========================
module             base weight            LoRA A [r, in]              LoRA B [out, r]
=================  =====================  ==========================  ==========================
q, k, v (column)   rows (heads) split     replicated                  rows (heads) split
o (row)            columns (heads) split  columns (heads) split       replicated
gate, up (column)  rows over I split      replicated [E, r, H]        rows over I split
down (row)         columns over I split   columns over I split        replicated [E, H, r]
EP (any MoE)       experts split          experts split               experts split
=================  =====================  ==========================  ==========================

Why no LoRA collective: a column-parallel module's shrink ``A x`` needs the whole input, which every
rank has, and its expand ``B_j (A x)`` gives exactly rank j's output columns, as the base does. A
row-parallel module gets its input split (``x_j``); rank j's shrink ``A_j x_j`` is a partial sum of
the full shrink, and since the expand is linear, ``Σ_j B (A_j x_j) = B (A x)``: each rank adds its
partial delta to its partial base output and the one all-reduce that sums the base output (after
o, and after the MoE block: the top-k sum and the router weights are linear too) sums the delta
with it. σ is per slot and the same on every rank.

Rank padding: factors are sharded at the adapter's own rank r, never along r, and each rank's pool
pads r to the pool's R on the right exactly as at TP = 1. So every rank's shrink output has the same
rank columns (0..r-1, zeros after), and gathering the ranks' pools along the sharded dimension gives
the TP = 1 pool bit for bit — zeros never interleave into the rank axis (vLLM's fully sharded MoE
loader once split A's rank into r/tp shards and padded each, which interleaved zeros into the
gathered shrink output; ``test_rank_below_pool_rank_gathers_to_the_tp1_pool`` pins this and catches
that loader).
"""

from __future__ import annotations

import dataclasses

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.checkpoint import AdapterWeights, MoEModelConfig
from moelora_core.checkpoint.layout import DecoderLayerWeights
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import ModuleLoRA
from moelora_runner.parallel.layout import ParallelLayout


def _rows(t: torch.Tensor, start: int, size: int, dim: int) -> torch.Tensor:
    return t.narrow(dim, start, size).contiguous()


def head_slices(config: MoEModelConfig, layout: ParallelLayout) -> tuple[tuple[int, int], tuple[int, int]]:
    """((start, size) of this rank's q features, (start, size) of its k / v features)."""
    nh, nkv = layout.heads(config)
    d, r = config.head_dim, layout.tp_rank
    return (r * nh * d, nh * d), (r * nkv * d, nkv * d)


def local_layer_spec(config: MoEModelConfig, layout: ParallelLayout, *, max_loras: int, max_rank: int,
                     dtype: torch.dtype, device: torch.device) -> LoRALayerSpec:
    """The ``LoRALayerSpec`` of one layer on this rank: local I, local experts, local q/k/v/o widths."""
    (_, q), (_, kv) = head_slices(config, layout)
    h = config.hidden_size
    return LoRALayerSpec(hidden_size=h, moe_intermediate_size=layout.intermediate(config)[1],
                         num_experts=layout.experts(config)[1], top_k=config.top_k,
                         dense_shapes={"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)},
                         max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=torch.device(device))


def shard_moe(moe: MoEBaseWeights, config: MoEModelConfig, layout: ParallelLayout) -> MoEBaseWeights:
    """This rank's experts / I slice of one MoE block; the router is left out (it stays whole, with the
    caller: routing is computed on every rank over every expert)."""
    w_gate_up, w_down = moe.w_gate_up, moe.w_down
    first, count = layout.experts(config)
    if layout.ep > 1:
        w_gate_up, w_down = _rows(w_gate_up, first, count, 0), _rows(w_down, first, count, 0)
    start, size = layout.intermediate(config)
    if layout.moe_tp > 1:
        full = config.moe_intermediate_size
        w_gate_up = torch.cat([w_gate_up[:, start:start + size], w_gate_up[:, full + start:full + start + size]], 1)
        w_down = _rows(w_down, start, size, 2)
    return MoEBaseWeights(w_gate_up=w_gate_up.contiguous(), w_down=w_down.contiguous(), router=None,
                          num_experts=count, norm_topk_prob=moe.norm_topk_prob)


def shard_layer(w: DecoderLayerWeights, config: MoEModelConfig, layout: ParallelLayout) -> DecoderLayerWeights:
    """This rank's base weights of one decoder layer (module table); the norms stay whole except
    OLMoE's q/k norms over all heads, which follow their heads."""
    (q0, qn), (k0, kn) = head_slices(config, layout)
    full_norm = config.family.qk_norm == "full" and layout.tp > 1
    return DecoderLayerWeights(
        q_proj=_rows(w.q_proj, q0, qn, 0), k_proj=_rows(w.k_proj, k0, kn, 0), v_proj=_rows(w.v_proj, k0, kn, 0),
        o_proj=_rows(w.o_proj, q0, qn, 1),
        q_norm=_rows(w.q_norm, q0, qn, 0) if full_norm else w.q_norm,
        k_norm=_rows(w.k_norm, k0, kn, 0) if full_norm else w.k_norm,
        input_layernorm=w.input_layernorm, post_attention_layernorm=w.post_attention_layernorm,
        moe=shard_moe(w.moe, config, layout))


def shard_module(module: str, lora: ModuleLoRA, config: MoEModelConfig, layout: ParallelLayout) -> ModuleLoRA:
    """One module's factors on this rank (module table), at the adapter's own rank r."""
    A, B = lora.lora_A, lora.lora_B
    if module in ("gate", "up", "down"):
        if layout.ep > 1:
            first, count = layout.experts(config)
            # a factor shared by every expert ([1, ...]: shared-outer, fully shared) is replicated on
            # every expert-parallel rank, not split
            A = A if A.shape[0] == 1 else _rows(A, first, count, 0)
            B = B if B.shape[0] == 1 else _rows(B, first, count, 0)
        if layout.moe_tp > 1:
            start, size = layout.intermediate(config)
            if module == "down":
                A = _rows(A, start, size, 2)   # [E, r, I/tp]: row-parallel, input split
            else:
                B = _rows(B, start, size, 1)   # [E, I/tp, r]: column-parallel, output split
    elif layout.tp > 1:
        (q0, qn), (k0, kn) = head_slices(config, layout)
        if module == "o":
            A = _rows(A, q0, qn, 1)            # [r, heads/tp · d]: row-parallel, input split
        else:
            start, size = (q0, qn) if module == "q" else (k0, kn)
            B = _rows(B, start, size, 0)       # [heads/tp · d, r]: column-parallel, output split
    return ModuleLoRA(A, B, lora.scaling)


def shard_adapter(adapter: AdapterWeights, config: MoEModelConfig, layout: ParallelLayout) -> AdapterWeights:
    """The adapter as this rank's pools hold it (every module through :func:`shard_module`); the
    adapter-level σ, ranks and config are unchanged."""
    if not layout.parallel:
        return adapter
    layers = tuple({m: shard_module(m, lora, config, layout) for m, lora in modules.items()}
                   for modules in adapter.layers)
    return dataclasses.replace(adapter, layers=layers)
