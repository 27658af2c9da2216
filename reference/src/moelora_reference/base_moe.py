"""The vectorised, graph-safe base MoE path: routing, per-pair GEMMs, activation, top-k sum.

What the suite's layer harness runs around a backend's delta calls (DESIGN.md §5):

    topk_weights, topk_ids = route_topk(router_logits, top_k, renormalize)
    y = moe_forward(x, topk_ids, topk_weights, base, deltas=BackendMoEDeltas(backend, pool, info))

    where moe_forward is, with ``deltas`` adding the LoRA terms in place:

    gate_up_out = gate_up(x, topk_ids, base)                 # [T, k, 2I]
    deltas.gate_up(x, topk_ids, gate_up_out)                 # backend.moe_gate_up_delta
    h = activation(gate_up_out)                              # [T·k, I]
    down_out = down(h, topk_ids, topk_weights, base)         # [T, k, H], router-weighted
    deltas.down(h, topk_ids, topk_weights, down_out)         # backend.moe_down_delta
    y = topk_sum(down_out)                                   # [T, H]

Per pair (t, j) with expert e = topk_ids[t, j]:

    gate_up_out[t, j] = W_gate_up[e] x[t] (+ b_gate_up[e])
    h[t·k + j]        = act(gate_up_out[t, j, :I], gate_up_out[t, j, I:])   (silu(g) ⊙ u, or GPT-OSS's
                                                                            clamped swiglu_oai)
    down_out[t, j]    = w[t, j] · (W_down[e] h[t·k + j] (+ b_down[e]))
    y[t]              = Σ_j down_out[t, j]

Sentinels: a pair with e < 0 (``EXPERT_NOT_HERE``) gets zeros in ``gate_up_out`` and ``down_out``
(it contributes nothing); ids in ``[E, E_base)`` are extra fused experts and take the base path
like any other. Ids >= E_base are outside the contract: they contribute nothing here (checking them
would need a host read; :func:`check_topk_ids` does that, outside graphs).

Graph safety: no ``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``, no data-dependent shape
and no Python branch on device values. Each pair gathers its expert's weights (``W[ids]``) and runs a
batched mat-vec; tokens are processed in chunks whose size comes from host shapes only, so the
gathered weights stay within a memory budget whatever T is.

fp8 block-scaled experts (``base.weight_block``, DESIGN.md §1): the base GEMMs read their input
quantized per token per K-group and the dequantized weights
(:mod:`moelora_reference.fp8_block`), in fp32; the deltas still read the unquantized x and h.

Rounding points: GEMMs accumulate in fp32; ``gate_up_out``, ``h``, ``down_out`` and ``y`` are each
rounded once to ``out_dtype`` (default: the input's dtype, as the Triton path does). A caller that
compares against the oracle keeps the intermediates in fp32 (``out_dtype=torch.float32``) so only
``y`` is rounded: with fp16 intermediates a LoRA pair sees up to six roundings (base, base + delta,
h, down, down + delta, y), which on tiny outputs (T = 1, H = 6) exceeds the fp16 RMS bound of the
tolerance policy. :func:`moe_forward` does that. Routing is fp32 softmax → top-k → optional
renormalisation.

Source: the fused MoE of vLLM / SGLang and Mixtral / Qwen3-MoE SwiGLU experts; the one equation is
in :mod:`moelora_reference.oracle`.
"""

from __future__ import annotations

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.errors import InvalidFieldError
from moelora_core.moe_activation import SILU, MoEActivation, check_layout
from moelora_core.moe_deltas import MoEDeltas
from moelora_reference.fp8_block import dequantize_activation, dequantize_weight

F32 = torch.float32
#: Elements of gathered fp32 weights per chunk: small on the CPU (cache-friendly), larger on GPUs.
GATHER_BUDGET = {"cpu": 1 << 22, "cuda": 1 << 26}


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, the top_k largest, optionally renormalised to sum to 1.

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.
        renormalize: divide the k weights by their sum (``norm_topk_prob``).

    Returns:
        (topk_weights [T, k] fp32, topk_ids [T, k] int32), in descending weight order.
    """
    probs = torch.softmax(router_logits.to(F32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def gather_matvec(inp: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...], *,
                  fp8: tuple[torch.Tensor, tuple[int, int], int | None] | None = None) -> torch.Tensor:
    """out[t, p] = weight[index(t, p)] @ inp[t, p] in fp32, chunked over t.

    Args:
        inp: [T, P, in] (a broadcast view such as ``x[:, None].expand(T, P, in)`` is fine).
        weight: [*lead, out, in]; ``index`` has one [T, P] long tensor per lead dim, each in range.
        index: the gather indices (callers clamp sentinels into range and mask the result).
        fp8: (scale_inv [*lead, rows, ⌈in/bk⌉], block, half) for fp8 block-scaled weights: each gathered
            chunk is dequantized (``moelora_reference.fp8_block.dequantize_weight``) before the product.

    Returns:
        [T, P, out] fp32.
    """
    T, P = index[0].shape
    n_out, n_in = weight.shape[-2:]
    out = torch.empty(T, P, n_out, dtype=F32, device=inp.device)
    budget = GATHER_BUDGET.get(inp.device.type, GATHER_BUDGET["cuda"])
    chunk = max(1, budget // max(1, P * n_out * n_in))
    for start in range(0, T, chunk):  # T is a host shape: a fixed loop, recorded as is
        stop = min(T, start + chunk)
        idx = tuple(i[start:stop] for i in index)
        w = weight[idx].to(F32) if fp8 is None else dequantize_weight(weight[idx], fp8[0][idx], fp8[1], fp8[2])
        out[start:stop] = torch.einsum("cpoi,cpi->cpo", w, inp[start:stop].to(F32))
    return out


def _base_index(topk_ids: torch.Tensor, num_base_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [T, k] bool, clamped ids [T, k] long): a sentinel pair reads expert 0 and is masked."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_base_experts)
    return valid, torch.where(valid, ids, torch.zeros_like(ids))


def _check(x: torch.Tensor, topk_ids: torch.Tensor, base: MoEBaseWeights) -> None:
    if x.dim() != 2 or x.shape[1] != base.hidden_size:
        raise InvalidFieldError("x", f"expected [T, H={base.hidden_size}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.is_floating_point():
        raise InvalidFieldError("topk_ids", f"expected integer [T={x.shape[0]}, k], got {topk_ids.dtype} "
                                            f"{tuple(topk_ids.shape)}")


def gate_up(x: torch.Tensor, topk_ids: torch.Tensor, base: MoEBaseWeights, *,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Base gate and up projections per (token, k): [T, k, 2I] in ``out_dtype`` (default x's), zeros
    for e < 0.

    Raises:
        InvalidFieldError: x not [T, H] or topk_ids not integer [T, k].
    """
    _check(x, topk_ids, base)
    T, k = topk_ids.shape
    dtype = x.dtype
    valid, ids = _base_index(topk_ids, base.w_gate_up.shape[0])
    fp8 = None
    if base.weight_block is not None:  # w8a8 (DESIGN.md §1): the base reads x quantized per token per K-group
        x = dequantize_activation(x, base.weight_block[1])
        fp8 = (base.w_gate_up_scale_inv, base.weight_block, base.intermediate_size)
    out = gather_matvec(x[:, None, :].expand(T, k, x.shape[1]), base.w_gate_up, (ids,), fp8=fp8)
    if base.b_gate_up is not None:  # GPT-OSS: the bias belongs to the base GEMM (DESIGN.md §1)
        out = out + base.b_gate_up.to(F32)[ids]
    return torch.where(valid[..., None], out, torch.zeros_like(out)).to(out_dtype or dtype)


def gated_activation(g: torch.Tensor, u: torch.Tensor, act: MoEActivation = SILU) -> torch.Tensor:
    """h = silu(g) ⊙ u, or GPT-OSS's ``swiglu_oai``: min(g, L) · sigmoid(α min(g, L)) ⊙ (clamp(u, ±L) + 1),
    elementwise in g's dtype (moelora_core.moe_activation; transformers ``GptOssExperts._apply_gate``)."""
    if act.kind == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=act.limit)
    u = u.clamp(min=-act.limit, max=act.limit)
    return g * torch.sigmoid(act.alpha * g) * (u + 1)


def split_gate_up(gate_up_out: torch.Tensor, layout: str = "halves") -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of [.., 2I] rows in ``layout`` ("halves": [:I], [I:]; "interleaved": 0::2, 1::2)."""
    if check_layout(layout) == "interleaved":
        return gate_up_out[..., 0::2], gate_up_out[..., 1::2]
    return gate_up_out.split(gate_up_out.shape[-1] // 2, dim=-1)


def activation(gate_up_out: torch.Tensor, *, act: MoEActivation = SILU, layout: str = "halves",
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """h = act(gate, up) (:func:`gated_activation`), computed in fp32 and rounded once: [T·k, I] in
    ``out_dtype`` (default gate_up_out's).

    Args:
        gate_up_out: [T, k, 2I]. act: the block's activation. layout: "halves" or "interleaved".

    Raises:
        InvalidFieldError: an unknown layout.
    """
    T, k, two_i = gate_up_out.shape
    g, u = split_gate_up(gate_up_out.to(F32), layout)
    return gated_activation(g, u, act).to(out_dtype or gate_up_out.dtype).reshape(T * k, two_i // 2)


def down(h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, base: MoEBaseWeights, *,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Router-weighted base down projection per pair: [T, k, H] in ``out_dtype`` (default h's), zeros
    for e < 0.

    Args:
        h: [T·k, I], row ``t·k + j`` for pair (t, j).
        topk_ids: [T, k]. topk_weights: [T, k] router weights (used in fp32).

    Raises:
        InvalidFieldError: mismatched shapes.
    """
    T, k = topk_ids.shape
    if tuple(h.shape) != (T * k, base.intermediate_size):
        raise InvalidFieldError("h", f"expected [{T * k}, {base.intermediate_size}], got {tuple(h.shape)}")
    if tuple(topk_weights.shape) != (T, k):
        raise InvalidFieldError("topk_weights", f"expected [{T}, {k}], got {tuple(topk_weights.shape)}")
    valid, ids = _base_index(topk_ids, base.w_down.shape[0])
    h_base, fp8 = h, None
    if base.weight_block is not None:  # w8a8: the base down GEMM reads h quantized (the down delta reads h)
        h_base = dequantize_activation(h, base.weight_block[1])
        fp8 = (base.w_down_scale_inv, base.weight_block, None)
    out = gather_matvec(h_base.reshape(T, k, base.intermediate_size), base.w_down, (ids,), fp8=fp8)
    if base.b_down is not None:  # GPT-OSS: (W_down h + b_down) · w, the bias router-weighted too
        out = out + base.b_down.to(F32)[ids]
    out = out * topk_weights.to(F32)[..., None]
    return torch.where(valid[..., None], out, torch.zeros_like(out)).to(out_dtype or h.dtype)


def topk_sum(down_out: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[t] = Σ_j down_out[t, j], summed in fp32 and rounded once: [T, H] in ``out_dtype``
    (default down_out's)."""
    return down_out.to(F32).sum(dim=1).to(out_dtype or down_out.dtype)


def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, base: MoEBaseWeights, *,
                deltas: MoEDeltas | None = None, intermediate_dtype: torch.dtype = F32,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The MoE layer on this torch base path, with the LoRA deltas of ``deltas`` (None = base only).

    One of the two places the MoE sequence is written (DESIGN.md §6; the other is
    ``moelora_kernels.fused_moe``): base gate_up → ``deltas.gate_up`` → activation → base down →
    ``deltas.down`` → top-k sum.

    Args:
        x: [T, H] activations. topk_ids: [T, k] int expert ids. topk_weights: [T, k] router weights.
        base: the layer's base expert weights.
        deltas: a :class:`moelora_core.moe_deltas.MoEDeltas` (e.g. ``BackendMoEDeltas(backend,
            pool, info)``), or None.
        intermediate_dtype: dtype of ``gate_up_out``, ``h`` and ``down_out`` (fp32: only y is
            rounded, as the suite's harness compares against the oracle; the model dtype: as an
            engine stores them).
        out_dtype: dtype of y (default x's).

    Returns:
        y [T, H] in ``out_dtype``.

    Raises:
        InvalidFieldError: x not [T, H] or topk_ids not integer [T, k].
    """
    gate_up_out = gate_up(x, topk_ids, base, out_dtype=intermediate_dtype)
    if deltas is not None:
        deltas.gate_up(x, topk_ids, gate_up_out)
    h = activation(gate_up_out, act=base.activation)
    down_out = down(h, topk_ids, topk_weights, base)
    if deltas is not None:
        deltas.down(h, topk_ids, topk_weights, down_out)
    return topk_sum(down_out, out_dtype=out_dtype or x.dtype)


def check_topk_ids(topk_ids: torch.Tensor, num_base_experts: int) -> None:
    """Refuse expert ids >= E_base (reads the ids on the host: for eager callers, never in a graph).

    Raises:
        InvalidFieldError: naming the first offending (token, k) and id.
    """
    bad = (topk_ids >= num_base_experts).nonzero()
    if bad.numel():
        t, j = bad[0].tolist()
        raise InvalidFieldError(f"topk_ids[{t}, {j}]",
                                f"expert {int(topk_ids[t, j])} >= number of base experts {num_base_experts}")
