"""One decoder layer: the oracle against a transformers (+ peft) layer, MoE block and attention
projections, fp32, by the tolerance policy's norms (max and RMS relative error <= 1e-5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_core import DEFAULT_POLICY, NO_ADAPTER, LoRAWeights, MoEBaseWeights, SharedExpertWeights
from moelora_reference.oracle import dense_lora_forward, moe_lora_forward, route_block, shared_expert_forward

#: Slot the adapter is loaded into: not 0, so a reader or kernel that ignores the slot index fails.
SLOT = 1
#: Tokens per layer check.
TOKENS = 32


@dataclass(frozen=True)
class CheckRow:
    """One comparison.

    Attributes:
        model, adapter: fixture names ("(base)" for the model alone).
        source: where the oracle's weights came from: "hf-memory" (transformers / peft modules),
            "readers" (moelora_core.checkpoint from disk), "readers σ·√2" (the readers' factors with
            peft's converted σ on gate/up), or "per-module" (readers vs a per-module reference);
            "engine": the whole model served by moelora_runner (``hf_check.model_logprobs``).
        layer: decoder layer (-1: the whole model or adapter).
        part: "moe", "routing", a dense module ("q", "k", "v", "o", "shared_gate", "shared_up",
            "shared_down") or "rank/σ"; "logprobs" for the engine's whole-model prompt logprobs.
        max_rel, rms_rel: errors against the expected side (see ``expect``); for "logprobs" the max
            and the mean absolute logprob difference.
        delta_rel: ||LoRA output − base output|| / ||base output|| of the oracle (None for base).
        ok: the check passed.
        expect: "equal" (within tolerance) or "diverge" (a documented divergence: must differ).
        note: details (failures, documented divergence).
    """

    model: str
    adapter: str
    source: str
    layer: int
    part: str
    max_rel: float
    rms_rel: float
    delta_rel: float | None
    ok: bool
    expect: str = "equal"
    note: str = ""


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weight, id) pairs sorted by expert id: routings compare whatever their top-k order."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _delta_rel(with_lora: torch.Tensor, base: torch.Tensor) -> float:
    return float((with_lora - base).norm() / base.norm().clamp_min(1e-300))


def compare_layer(
    *,
    model: str,
    adapter: str,
    source: str,
    layer: int,
    moe: MoEBaseWeights,
    dense: dict[str, torch.Tensor],
    pool: LoRAWeights | None,
    top_k: int,
    hf_moe,
    hf_route,
    hf_dense,
    seed: int,
    expect: str = "equal",
    diverge_bound: float = 1e-2,
    shared: SharedExpertWeights | None = None,
    dense_bias: dict[str, torch.Tensor] | None = None,
    dense_scales: dict[str, torch.Tensor] | None = None,
    weight_block: tuple[int, int] | None = None,
) -> list[CheckRow]:
    """Compare the oracle with the HF side on fresh random inputs.

    Args:
        moe, dense: base weights fed to the oracle.
        pool: LoRA pool with the adapter in slot :data:`SLOT`, or None for the base model.
        hf_moe(x) → [T, H]; hf_route(x) → (weights, ids); hf_dense(module, x) → [T, out]: the HF side.
        seed: input seed.
        expect: "equal", or "diverge" for the documented peft divergence (the MoE block must then
            differ by more than ``diverge_bound``; routing and attention must still be equal).
        shared: the layer's shared expert (Qwen2-MoE, DeepSeek-V3): the MoE block is then the routed
            experts plus the oracle's (gated) shared expert with the pool's shared-expert LoRA. With
            ``moe`` None (DeepSeek-V3's dense layers) the dense MLP, compared as the row "mlp".
        dense_bias: module → [out] bias of the dense projections that have one (Qwen2-MoE's q/k/v).
        dense_scales, weight_block: an fp8 block-scaled layer's dense ``weight_scale_inv`` by module and
            its block: those projections — the shared expert's among them, inside the MoE block too —
            are computed w8a8 by the oracle (``moe``'s own ``weight_block`` makes its experts w8a8) and
            held to the policy's fp8 rows (DESIGN.md §1).

    Returns:
        One row for routing, one for the MoE block, one per dense projection.
    """
    gen = torch.Generator().manual_seed(seed)
    T, H = TOKENS, moe.hidden_size if moe is not None else shared.gate_proj.shape[1]
    x = torch.randn(T, H, generator=gen)
    mapping = torch.full((T,), SLOT if pool is not None else NO_ADAPTER, dtype=torch.int32)
    rows: list[CheckRow] = []

    dense_scales = dense_scales or {}

    def row(part: str, actual: torch.Tensor, expected: torch.Tensor, delta: float | None, part_expect: str,
            fp8: bool = False):
        rep = DEFAULT_POLICY.check(actual, expected, dtype=torch.float32, what=f"{model}/{adapter} L{layer} {part}",
                                   seed=seed, base_quant="fp8_block" if fp8 else "none")
        if part_expect == "diverge":
            ok = rep.non_finite == 0 and rep.max_rel > diverge_bound
            note = f"differs as documented (max_rel {rep.max_rel:.2e} > {diverge_bound:.0e})" if ok else \
                "expected the documented peft divergence, found agreement"
        else:
            ok, note = rep.ok, ("" if rep.ok else rep.message())
        rows.append(CheckRow(model, adapter, source, layer, part, rep.max_rel, rep.rms_rel, delta, ok,
                             part_expect, note))

    if moe is not None:
        # Routing: the oracle's routing (the block's own rule) on the same input picks the same experts
        # (exactly), compared as pairs sorted by expert id (DeepSeek-V3's top-k order is unspecified).
        hf_w, hf_ids = _by_id(*hf_route(x))
        ids0, w0 = route_block(x, top_k, moe)[::-1]
        w, ids = _by_id(w0, ids0)
        same_ids = torch.equal(ids, hf_ids.to(ids.dtype))
        wrep = DEFAULT_POLICY.check(hf_w, w, dtype=torch.float32, what="topk_weights")
        rows.append(CheckRow(model, adapter, source, layer, "routing", wrep.max_rel, wrep.rms_rel, None,
                             same_ids and wrep.ok, "equal",
                             "" if same_ids else f"topk_ids differ in {int((ids != hf_ids).sum())} places"))

    def block(lora: LoRAWeights | None) -> torch.Tensor:
        y = torch.zeros(T, H, dtype=torch.float64) if moe is None else moe_lora_forward(
            x, ids0, w0, moe.w_gate_up, moe.w_down, lora, mapping, b_gate_up=moe.b_gate_up, b_down=moe.b_down,
            activation=moe.activation, weight_block=moe.weight_block, w_gate_up_scale_inv=moe.w_gate_up_scale_inv,
            w_down_scale_inv=moe.w_down_scale_inv)
        if shared is None:
            return y
        scales = {m: sc for m, sc in dense_scales.items() if m in shared.modules}
        return y + shared_expert_forward(x, shared, lora, mapping, weight_block=weight_block if scales else None,
                                         weight_scales=scales)

    y = block(pool)
    delta = None if pool is None else _delta_rel(y, block(None))
    # DeepSeek-V3's dense layers: the whole dense MLP, "mlp"
    fp8_shared = shared is not None and any(m in dense_scales for m in shared.modules)
    row("moe" if moe is not None else "mlp", hf_moe(x), y, delta, expect,
        fp8=(moe is not None and moe.weight_block is not None) or fp8_shared)

    for m, weight in dense.items():
        xd = torch.randn(T, weight.shape[1], generator=gen)
        bias = (dense_bias or {}).get(m)
        quant = dict(weight_block=weight_block, weight_scale_inv=dense_scales[m]) if m in dense_scales else {}
        yd = dense_lora_forward(xd, weight, m, pool, mapping, bias=bias, **quant)
        d = None
        if pool is not None and m in pool.dense_A and pool.host_ranks[m][SLOT]:
            d = _delta_rel(yd, dense_lora_forward(xd, weight, m, None, None, bias=bias, **quant))
        row(m, hf_dense(m, xd), yd, d, "equal", fp8=m in dense_scales)
    return rows
