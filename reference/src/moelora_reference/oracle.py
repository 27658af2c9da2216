"""The readable oracle: MoE multi-LoRA and dense LoRA, per token, per expert, in float64.

The one equation (DESIGN.md §1). For token t with adapter slot s = s(t) (or none), routed experts
e_1..e_k with router weights w_1..w_k, and per-module scalings σ:

    g_j = W_gate[e_j] x + σ_gate · B_gate[s,e_j] (A_gate[s,e_j] x)
    u_j = W_up[e_j]   x + σ_up   · B_up[s,e_j]   (A_up[s,e_j]   x)
    h_j = silu(g_j) ⊙ u_j
    y   = Σ_j w_j · ( W_down[e_j] h_j + σ_down · B_down[s,e_j] (A_down[s,e_j] h_j) )

Qwen2-MoE adds a dense shared expert to every token (:func:`shared_expert_forward`):

    s   = W_sd (silu(W_sg x + Δ_shared_gate) ⊙ (W_su x + Δ_shared_up)) + Δ_shared_down
    y  += sigmoid(w_gate · x) · s

with each Δ the dense LoRA delta σ·B(A ·) of that projection (modules shared_gate / shared_up /
shared_down).

GPT-OSS (transformers ``GptOssExperts``) adds expert biases and its clamped activation
(``activation=SWIGLU_OAI``; :func:`gated_activation`), the delta entering with the bias before the clamp:

    g_j = W_gate[e_j] x + b_gate[e_j] + Δ_gate,   u_j = W_up[e_j] x + b_up[e_j] + Δ_up
    h_j = min(g_j, L) · sigmoid(α · min(g_j, L)) ⊙ (clamp(u_j, -L, L) + 1)
    y   = Σ_j w_j · ( W_down[e_j] h_j + b_down[e_j] + Δ_down )

An fp8 block-scaled base (``base_quant`` "fp8_block", DESIGN.md §1) replaces each base product W v by
its w8a8 value, computed here in fp64 (:func:`fp8_block_matvec`):

    Ŵ[n, k]  = W_q[n, k] · scale_inv[⌊n/bn⌋, ⌊k/bk⌋]                 (dequantized weights)
    s_g      = fp32(max(amax_{k∈g} |v_k|, fp32(1e-10)) / 448)        per K-group g of bk (the last partial)
    v̂_k      = RNE_e4m3(clamp(fp32(v_k / s_g), ±448)) · s_g          (emulated activation quantization)
    W v     ↦ Ŵ v̂

while every LoRA delta reads the unquantized v (x for gate/up, h for down).

DeepSeek-V3 routes with :func:`moelora_reference.routing.route_grouped_sigmoid` (sigmoid scores, a
correction bias for selection only, group-limited top-k, renormalise, ``routed_scaling_factor``),
the one function the engine calls too; :func:`route_block` runs it here in float64.

Sources: LoRA (Hu et al., arXiv:2106.09685); SwiGLU experts as in Mixtral / Qwen3-MoE
(transformers ``Qwen3MoeExperts``); the multi-LoRA MoE layout of SGLang's MoE-LoRA PR
(sgl-project/sglang#14105) and vLLM's fused MoE-LoRA.

Rules encoded here (and nowhere cleverer):

- A negative expert id (``EXPERT_NOT_HERE``) contributes nothing, base or LoRA.
- An id in ``[E_lora, E_base)`` is an extra fused expert of the base layer: base only, no LoRA.
- An id >= E_base is invalid and raises.
- A token with slot ``NO_ADAPTER`` (or a module of rank 0) gets exactly the base output.
- σ comes from ``LoRAWeights.module_scalings`` (fp32), applied at run time.

Loops are intentional: this code is slow and obviously right.
"""

from __future__ import annotations

import math

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.errors import InvalidFieldError
from moelora_core.moe_activation import SILU, MoEActivation
from moelora_core.sentinels import NO_ADAPTER
from moelora_core.shared_expert import SharedExpertWeights
from moelora_core.weights import LoRAWeights
from moelora_reference.routing import route

F64 = torch.float64
F32 = torch.float32
#: The largest finite e4m3 value and the scale's amax floor, as the contract defines them (DESIGN.md §1).
E4M3_MAX = 448.0
AMAX_FLOOR = float(torch.tensor(1e-10, dtype=F32))


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """The e4m3 value nearest to each fp64 element of v (|v| <= 448), ties to the even mantissa.

    e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; normals from 2^-6, subnormals k · 2^-9.
    Between 2^e and 2^(e+1) (e >= -6) the values are spaced 2^(e-3); below 2^-6 they are spaced 2^-9.
    """
    a = v.to(F64).abs()
    _, exp = torch.frexp(a)  # a = m · 2^exp with m in [0.5, 1): floor(log2 a) = exp - 1, exactly
    e = torch.where(a > 0, exp - 1, torch.full_like(exp, -6)).clamp(min=-6)
    spacing = torch.pow(torch.full_like(a, 2.0), (e - 3).to(F64))
    n = a / spacing  # exact: a power-of-two division
    lower = torch.floor(n)
    frac = n - lower
    odd = torch.remainder(lower, 2) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)  # nearest, ties to the even multiple
    return torch.where(v < 0, -1.0, 1.0).to(F64) * torch.where(up, lower + 1, lower) * spacing


def fp8_group_quotients(v: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v [K] → (q [K], s [K]) fp64, what :func:`fp8_group_quantize` rounds: each K-group of ``block_k``
    (the last may be shorter) has its own scale s_g = fp32(max(amax, fp32(1e-10)) / 448), and q is the
    quotient v / s_g rounded to fp32 and clamped to ±448; s holds each element's s_g."""
    v = v.to(F64)
    quotient, scale = torch.empty_like(v), torch.empty_like(v)
    for start in range(0, v.shape[0], block_k):
        group = v[start:start + block_k]
        amax = max(float(group.abs().max()), AMAX_FLOOR)
        s = float(torch.tensor(amax / E4M3_MAX, dtype=F64).to(F32))  # the scale is an fp32 number
        # x / s in fp32 (fp64 then fp32: one correct rounding)
        quotient[start:start + block_k] = (group / s).to(F32).to(F64).clamp(-E4M3_MAX, E4M3_MAX)
        scale[start:start + block_k] = s
    return quotient, scale


def fp8_group_quantize(v: torch.Tensor, block_k: int) -> torch.Tensor:
    """v [K] → v̂ [K] fp64: each K-group of ``block_k`` quantized to e4m3 with its own scale
    (:func:`fp8_group_quotients`), the quotient rounded to e4m3 (ties to even) and multiplied back by s_g."""
    quotient, scale = fp8_group_quotients(v, block_k)
    return e4m3_round(quotient) * scale


def e4m3_ordinal(v: torch.Tensor) -> torch.Tensor:
    """int64 rank of each e4m3 value of v (a float tensor holding e4m3 values) in value order: adjacent
    e4m3 values have ranks one apart (sign-magnitude bits; ±0 both rank 0)."""
    bits = v.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    return torch.where(bits >= 0x80, -(bits - 0x80), bits)


def e4m3_from_ordinal(rank: torch.Tensor) -> torch.Tensor:
    """The e4m3 value (fp64) of each int64 rank of :func:`e4m3_ordinal`."""
    return torch.where(rank < 0, 0x80 - rank, rank).to(torch.uint8).view(torch.float8_e4m3fn).to(F64)


def fp8_dequantize(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Ŵ [N, K] fp64: every element of the fp8 weight W_q [N, K] times the scale of its (bn, bk) block
    (``scale_inv`` [⌈N/bn⌉, ⌈K/bk⌉]; edge blocks partial)."""
    bn, bk = block
    n, k = w_q.shape
    per_element = scale_inv.to(F64).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w_q.to(F64) * per_element


def fp8_block_matvec(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     v: torch.Tensor) -> torch.Tensor:
    """The w8a8 base product Ŵ v̂ of one fp8 weight [N, K] and one vector v [K], in fp64 ([N])."""
    return fp8_dequantize(w_q, scale_inv, block) @ fp8_group_quantize(v, block[1])


def _base_matvec(w: torch.Tensor, v: torch.Tensor, scale_inv: torch.Tensor | None,
                 block: tuple[int, int] | None) -> torch.Tensor:
    """W v in fp64, or its w8a8 value when the weight is fp8 block-scaled (``block`` given)."""
    if block is None:
        return w.to(F64) @ v
    return fp8_block_matvec(w, scale_inv, block, v)


def silu(x: torch.Tensor) -> torch.Tensor:
    """silu(x) = x · sigmoid(x)."""
    return x * torch.sigmoid(x)


def gated_activation(g: torch.Tensor, u: torch.Tensor, act: MoEActivation = SILU) -> torch.Tensor:
    """silu(g) ⊙ u, or ``swiglu_oai``: g' = min(g, L), u' = clamp(u, -L, L), g' · sigmoid(α g') ⊙ (u' + 1)
    (transformers 5.17 ``GptOssExperts._apply_gate``), elementwise."""
    if act.kind == "silu":
        return silu(g) * u
    g = torch.clamp(g, max=act.limit)
    u = torch.clamp(u, min=-act.limit, max=act.limit)
    return g * torch.sigmoid(act.alpha * g) * (u + 1)


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then the top_k largest, optionally renormalised to sum to 1.

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.
        renormalize: divide the k weights by their sum (Qwen3-MoE ``norm_topk_prob``, OLMoE's
            ``norm_topk_prob``; Mixtral renormalises always).

    Returns:
        (topk_weights [T, k] float64, topk_ids [T, k] int64), ids in descending weight order.
    """
    probs = torch.softmax(router_logits.to(F64), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_block(x: torch.Tensor, top_k: int, moe: MoEBaseWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Route x [T, H] by ``moe``'s own rule in float64: :func:`route_topk` of the router logits, or
    DeepSeek-V3's group-limited sigmoid (``moelora_reference.routing.route_grouped_sigmoid``, the
    function the engine runs in fp32) when ``moe.routing`` is set.

    Returns:
        (topk_weights [T, k] float64, topk_ids [T, k] int64).
    """
    if moe.routing is None:
        return route_topk(moe.router_logits(x), top_k, moe.norm_topk_prob)  # logits in x's dtype, as HF
    weights, ids = route(x, top_k, moe, dtype=F64)
    return weights, ids.long()


def lora_delta(A: torch.Tensor, B: torch.Tensor, scaling: float, x: torch.Tensor) -> torch.Tensor:
    """delta = σ · B @ (A @ x) for one vector.

    Args:
        A: [r, in]; B: [out, r]; x: [in]. Returns [out] float64.
    """
    return float(scaling) * (B.to(F64) @ (A.to(F64) @ x.to(F64)))


def moe_lora_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    lora: LoRAWeights | None,
    token_lora_mapping: torch.Tensor | None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: MoEActivation = SILU,
    weight_block: tuple[int, int] | None = None,
    w_gate_up_scale_inv: torch.Tensor | None = None,
    w_down_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE block with per-token LoRA adapters, one token and one routed expert at a time.

    Args:
        x: [T, H] input activations.
        topk_ids: [T, k] int expert ids (negative = not handled here).
        topk_weights: [T, k] router weights.
        w_gate_up: [E_base, 2I, H] base gate (rows [:I]) and up (rows [I:]) weights.
        w_down: [E_base, H, I] base down weights.
        lora: the adapter pool's weights (E_lora = ``lora.spec.E`` <= E_base), or None for base only.
        token_lora_mapping: [T] int slot per token, ``NO_ADAPTER`` = none (ignored if lora is None).
        b_gate_up: [E_base, 2I] expert biases (gate [:I], up [I:]) or None (GPT-OSS has them).
        b_down: [E_base, H] expert biases of down, or None; router-weighted with the projection.
        activation: the gated activation (GPT-OSS: ``SWIGLU_OAI``).
        weight_block: (bn, bk) when the expert weights are fp8 block-scaled (w8a8 base; the LoRA
            deltas still read the unquantized x and h), else None.
        w_gate_up_scale_inv: [E_base, 2·⌈I/bn⌉, ⌈H/bk⌉]: gate's grid, then up's.
        w_down_scale_inv: [E_base, ⌈H/bn⌉, ⌈I/bk⌉].

    Returns:
        y [T, H] float64.

    Raises:
        InvalidFieldError: an expert id >= E_base, a slot outside [-1, max_loras), or mismatched
            shapes.
    """
    T, H = x.shape
    E_base, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    if w_down.shape != (E_base, H, inter):
        raise InvalidFieldError("w_down", f"expected {(E_base, H, inter)}, got {tuple(w_down.shape)}")
    y = torch.zeros(T, H, dtype=F64)
    gate_rows = 0 if weight_block is None else math.ceil(inter / weight_block[0])

    if weight_block is not None:  # dequantize each expert once (Ŵ); the products stay w8a8 below
        deq = {e: (fp8_dequantize(w_gate_up[e, :inter], w_gate_up_scale_inv[e, :gate_rows], weight_block),
                   fp8_dequantize(w_gate_up[e, inter:], w_gate_up_scale_inv[e, gate_rows:], weight_block),
                   fp8_dequantize(w_down[e], w_down_scale_inv[e], weight_block)) for e in range(E_base)}

    def base(e: int, which: int, v: torch.Tensor) -> torch.Tensor:
        """W v of expert e's gate (0), up (1) or down (2), or its w8a8 Ŵ v̂."""
        if weight_block is None:
            w = (w_gate_up[e, :inter], w_gate_up[e, inter:], w_down[e])[which]
            return w.to(F64) @ v
        return deq[e][which] @ fp8_group_quantize(v, weight_block[1])

    for t in range(T):
        slot = NO_ADAPTER if lora is None else int(token_lora_mapping[t])
        if lora is not None and not NO_ADAPTER <= slot < lora.spec.max_loras:
            raise InvalidFieldError(f"token_lora_mapping[{t}]", f"slot {slot} outside [-1, {lora.spec.max_loras})")
        xt = x[t].to(F64)
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue  # EXPERT_NOT_HERE: handled by another rank
            if e >= E_base:
                raise InvalidFieldError(f"topk_ids[{t}, {j}]", f"expert {e} >= number of base experts {E_base}")
            g = base(e, 0, xt)  # [I]
            u = base(e, 1, xt)  # [I]
            if b_gate_up is not None:
                g = g + b_gate_up[e, :inter].to(F64)
                u = u + b_gate_up[e, inter:].to(F64)
            has_lora = slot != NO_ADAPTER and e < lora.spec.E
            if has_lora:
                g = g + lora_delta(lora.gate_A[slot, e], lora.gate_B[slot, e], lora.scalings("gate")[slot], xt)
                u = u + lora_delta(lora.up_A[slot, e], lora.up_B[slot, e], lora.scalings("up")[slot], xt)
            h = gated_activation(g, u, activation)  # [I]; the delta and bias came before the clamp
            out = base(e, 2, h)  # [H]; the down delta below reads the unquantized h
            if b_down is not None:
                out = out + b_down[e].to(F64)
            if has_lora:
                out = out + lora_delta(lora.down_A[slot, e], lora.down_B[slot, e], lora.scalings("down")[slot], h)
            y[t] += float(topk_weights[t, j]) * out
    return y


def moe_block_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: MoEBaseWeights,
    lora: LoRAWeights | None,
    token_lora_mapping: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`moe_lora_forward` of a whole ``MoEBaseWeights`` block: its weights, its expert biases
    (GPT-OSS), its activation and its fp8 block scales, so no caller drops one of them. Returns y [T, H] float64."""
    return moe_lora_forward(x, topk_ids, topk_weights, base.w_gate_up, base.w_down, lora, token_lora_mapping,
                            b_gate_up=base.b_gate_up, b_down=base.b_down, activation=base.activation,
                            weight_block=base.weight_block, w_gate_up_scale_inv=base.w_gate_up_scale_inv,
                            w_down_scale_inv=base.w_down_scale_inv)


def dense_lora_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    module: str,
    lora: LoRAWeights | None,
    token_lora_mapping: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    weight_block: tuple[int, int] | None = None,
    weight_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """A dense projection with per-token LoRA: y[t] = W x[t] (+ b) + σ_s · B[s] (A[s] x[t]); with an
    fp8 block-scaled W (``weight_block``, ``weight_scale_inv`` [⌈out/bn⌉, ⌈in/bk⌉]) the base product is
    its w8a8 value and the delta reads the unquantized x[t].

    Args:
        x: [T, in].
        weight: [out, in] base weight, or None to return the LoRA delta alone.
        module: "q", "k", "v", "o", "shared_gate", "shared_up" or "shared_down".
        lora: pool weights or None (base only).
        token_lora_mapping: [T] slot per token, ``NO_ADAPTER`` = none.
        bias: [out] the projection's bias (Qwen2-MoE's q/k/v), or None; only with ``weight``.

    Returns:
        [T, out] float64.
    """
    if weight is None and lora is None:
        raise InvalidFieldError("weight", "need a base weight or LoRA weights")
    fout = weight.shape[0] if weight is not None else lora.spec.module_shape(module)[1]
    y = torch.zeros(x.shape[0], fout, dtype=F64)
    for t in range(x.shape[0]):
        xt = x[t].to(F64)
        if weight is not None:
            y[t] = _base_matvec(weight, xt, weight_scale_inv, weight_block)
            if bias is not None:
                y[t] += bias.to(F64)
        slot = NO_ADAPTER if lora is None else int(token_lora_mapping[t])
        if slot != NO_ADAPTER:
            A, B = lora.factors(module)
            y[t] += lora_delta(A[slot], B[slot], lora.scalings(module)[slot], xt)
    return y


def shared_expert_forward(
    x: torch.Tensor,
    shared: SharedExpertWeights,
    lora: LoRAWeights | None,
    token_lora_mapping: torch.Tensor | None,
    *,
    weight_block: tuple[int, int] | None = None,
    weight_scales: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Qwen2-MoE's shared expert with per-token LoRA on its three projections, in float64:
    y[t] = sigmoid(w_gate · x[t]) · shared_down(silu(shared_gate(x[t])) ⊙ shared_up(x[t])) (no sigmoid
    factor where ``shared.gate`` is None: DeepSeek-V3's shared experts and dense MLPs), each
    projection W x + σ_s · B[s] (A[s] x) (:func:`dense_lora_forward`). A projection stored fp8
    block-scaled (its module in ``weight_scales``) computes its base product w8a8 — its input, x or
    the activated silu(g) ⊙ u, quantized per token per K-group — and its delta on the unquantized
    input, as every fp8 dense projection (DESIGN.md §1, "Quantized base"); the sigmoid gate is never
    quantized (``modules_to_not_convert``). Source: transformers ``Qwen2MoeSparseMoeBlock.forward``.

    Args:
        x: [T, H]. shared: the layer's shared expert. lora, token_lora_mapping: as
            :func:`dense_lora_forward` (a pool whose spec holds the three shared-expert modules).
        weight_block: (bn, bk) of an fp8 block-scaled checkpoint; with ``weight_scales``.
        weight_scales: module name (``shared.modules``) → ``weight_scale_inv`` [⌈out/bn⌉, ⌈in/bk⌉] of
            each projection stored fp8 (its weight then float8_e4m3fn); absent modules are unquantized.

    Returns:
        [T, H] float64: the term added to the routed experts' output.

    Raises:
        InvalidFieldError: ``weight_scales`` names a module the shared expert does not have, or is
            given without ``weight_block``.
    """
    scales = weight_scales or {}
    if scales and weight_block is None:
        raise InvalidFieldError("weight_block", "fp8 weight scales need the checkpoint's weight_block")
    unknown = sorted(set(scales) - set(shared.modules))
    if unknown:
        raise InvalidFieldError("weight_scales", f"{unknown} are not modules of this shared expert {shared.modules}")

    def quant(module: str) -> dict:
        return dict(weight_block=weight_block, weight_scale_inv=scales[module]) if module in scales else {}

    gate, up, down = shared.modules  # shared_* (or a DeepSeek-V3 dense MLP's dense_*)
    g = dense_lora_forward(x, shared.gate_proj, gate, lora, token_lora_mapping, **quant(gate))  # [T, Is]
    u = dense_lora_forward(x, shared.up_proj, up, lora, token_lora_mapping, **quant(up))  # [T, Is]
    s = dense_lora_forward(silu(g) * u, shared.down_proj, down, lora, token_lora_mapping, **quant(down))  # [T, H]
    if shared.gate is None:  # DeepSeek-V3: no gate
        return s
    return torch.sigmoid(x.to(F64) @ shared.gate.to(F64).T) * s  # [T, 1] gate
