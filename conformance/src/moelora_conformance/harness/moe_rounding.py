"""The rounding allowance of a MoE layer's output and LoRA delta, derived from the actual terms.

A correct backend's MoE delta is not the exact one: fused MoE-LoRA kernels round the shrink output
``A x`` and the delta ``σ·B(A x)`` to the activation dtype (vLLM's fused_moe_lora keeps both in fp16
or bf16), accumulate in fp32, and an engine stores the intermediates (``gate_up_out``, ``h``,
``down_out``) in the model dtype. Under cancellation — a small LoRA delta next to large terms — those
roundings are a large part of the delta: a correct backend rounding its gate_up delta to fp16 failed
the unallowed check at max_rel 4.1e-3 (bound 2e-3) on a one-token case
(``tests/test_suite_moe_rounding.py`` pins it). :func:`moe_rounding_scale` bounds, per output element,
what those roundings can do, to first order, from the case's own values (float64):

The block is the case's ``MoEBaseWeights`` (DESIGN.md §1): gate and up are the halves of
``gate_up_out`` as the harness's base path splits them (``moelora_reference.base_moe.split_gate_up``),
the expert biases (GPT-OSS) are added in the base GEMMs before their one rounding, and ``act`` is the
oracle's own ``gated_activation`` (SiLU, or GPT-OSS's clamped ``swiglu_oai`` with its α, limit L and
``(u + 1)``). For a pair (token t, slot k) with expert e, input x and router weight w, with ``u_a``
the unit roundoff of the activation dtype, ``u_i`` that of the intermediates' dtype, ``u₃₂`` fp32's,
and ``S`` = :data:`ROUNDING_SAFETY`, ``Λ`` = ``λ·u₃₂`` (λ = ``checks.ACCUMULATION_LAMBDA``, the dense
allowance's measured fp32 accumulation multiple):

- gate (and up alike): ``e_g = S·u_a·(|d_g| + σ‖|B| ⊙ |A x|‖₂) + Λ·σ·(‖|B| ⊙ m‖₂ + |B||A x|) + S·u_i·|g|``
  with ``d_g = σ·B(A x)``, ``m_r = Σ_i |A_ri x_i|``, ``g = W_g x + b_g + d_g`` (``b_g`` = 0 without
  biases): the shrink output and the delta rounded, their fp32 sums, and ``g`` stored;
- through the activation ``h = act(g, u)``: ``e_h = Δ_g + Δ_u + S·u_i·(|h| + |h₀|)`` with
  ``Δ_g = max_± |act(g ± e_g, u) − act(g, u)|`` and ``Δ_u`` alike (``h₀``: the LoRA-disabled twin's,
  rounded too). First order ``Δ_g = |∂h/∂g|·e_g``: ``|silu'(g)||u|·e_g`` for SiLU; for
  ``swiglu_oai`` (``h = f(min(g, L))·(clamp(u, ±L) + 1)``, ``f(z) = z·sigmoid(α z)``) it is
  ``|f'(g)||clamp(u) + 1|·e_g`` below the limit, 0 strictly inside the clamped region (``g > L +
  e_g``), and within ``e_g`` of the limit, where a rounding can cross it, at most the unclamped slope
  times ``e_g``; ``Δ_u`` is ``|f(min(g, L))|·e_u`` unless u is clamped. The interval form is that
  bound without a case for each activation (the cross term ``e_g·e_u`` is second order);
- through the down projection and its delta: ``|w|·‖D ⊙ e_h‖₂`` per output row, ``D = |W_d| +
  σ_d|B_d||A_d|``, plus the down delta's own roundings (as the gate's, on ``h``, times ``|w|``; where
  ``h`` is handed in fp32, the backend may round it to the activation dtype first: ``u_a·m_d`` more
  per shrink output),
  the fp32 down GEMMs of both runs ``Λ·|w|·|W_d|(|h| + |h₀|)`` and the stored down outputs and their
  top-k sum ``(S·u_i + Λ)·|w|·(|out| + |out₀|)``, ``out = W_d h + b_d + d_o`` (the bias in the stored
  value);
- summed over the token's pairs.

Rounding to nearest is off by at most ``u·|value|`` per rounding; first order, the errors reach the
output through the absolute Jacobians, and since each element is rounded on its own, independent
errors add in ℓ2 (the dense allowance's model: ``checks`` module docstring); ``S = 2`` covers the
second-order terms and the composition of roundings. Measured over 150 draws at the interpret caps
in fp16 (the production-style example backend), the worst error is 0.58 of the allowance on SwiGLU
blocks and 0.45 on GPT-OSS's (``tests/test_suite_moe_rounding.py`` keeps both under 3/4). Before the
allowance followed the block (no biases, silu), GPT-OSS's reached 0.78 of it on the output (3.75 with
the intermediates in fp16), and a correct backend failed a one-token GPT-OSS delta check (a named test).

Only pairs with LoRA contribute to the *delta* scale (base pairs are bit-identical in the run and
its twin, P02); the *output* scale (``include_base``) adds every pair's base roundings: a small
output next to a large delta carries the delta's roundings too. The price, on well-conditioned
deltas: a median 2.8e-5 of ``|delta|`` per element in fp32 at the interpret caps (3.7e-5 at the dev
caps; GPT-OSS blocks alike; a 5e-5 error is still caught on every draw of either block, tested),
8.7e-3 in fp16 (the fp16 bound is 2e-3: a backend rounding as the fused kernels do carries up to half
of that on these draws), 1.7e-2 with the intermediates in fp16.
"""

from __future__ import annotations

import torch

from moelora_conformance.harness.checks import ACCUMULATION_LAMBDA, UNIT_ROUNDOFF
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.moe_activation import MoEActivation
from moelora_reference.base_moe import split_gate_up
from moelora_reference.fp8_block import dequantize_moe
from moelora_reference.oracle import gated_activation

F64 = torch.float64
#: Multiple of ``u·|value|`` allowed per rounding (first order is exact at 1; see the module docstring).
ROUNDING_SAFETY = 2.0


def _lora(lora, module: str, slot: int, e: int):
    A, B = lora.factors(module)
    return A[slot, e].to(F64), B[slot, e].to(F64), float(lora.scalings(module)[slot])


def _delta_terms(inp: torch.Tensor, A: torch.Tensor, B: torch.Tensor, sigma: float, u_a: float,
                 lam: float, *, input_rounded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(delta [n, out], its rounding error bound [n, out], shrink |A inp| [n, R]) of σ·B(A inp) for
    rows ``inp``; ``input_rounded``: the backend may round ``inp`` itself to the activation dtype first
    (the down stage's fp32 ``h``: kernels take their input in the weights' dtype)."""
    a = inp @ A.T  # [n, R]
    d = sigma * (a @ B.T)  # [n, out]
    B2 = B.square()
    m = inp.abs() @ A.abs().T  # [n, R] Σ|A_ri x_i|
    expand = a.abs() @ B.abs().T  # [n, out] |B||A x|: the expand sum's terms
    # the R shrink outputs are rounded (to the activation dtype) and summed (in fp32) independently:
    # their errors reach the output in ℓ2 through B
    shrink_err = a.square() + (m.square() if input_rounded else 0.0)  # rounded shrink, rounded input
    err = (u_a * (d.abs() + abs(sigma) * (shrink_err @ B2.T).sqrt())
           + lam * abs(sigma) * ((m.square() @ B2.T).sqrt() + expand))
    return d, err, a


def dense_activation_rounding(x: torch.Tensor, module: str, lora, token_lora_mapping: torch.Tensor, *,
                              act_dtype: torch.dtype) -> torch.Tensor:
    """What a dense delta ``σ·B(A x)`` may be off by when a backend rounds its shrink output and its
    delta to the activation dtype (the segmented and chunked LoRA kernels store the shrink output in
    it): ``S·u_a·(|d| + σ‖|B| ⊙ |A x|‖₂)`` per token and column, float64 on the CPU. Added to the
    fp32 accumulation allowance of ``expected.dense_delta_rounding_scale``; in fp32 it is ``2u₃₂``-small.

    Args:
        x: [T, in]; module: "q".."o"; lora: the adapters; token_lora_mapping: [T] (``NO_ADAPTER``: 0).
    """
    x = x.detach().to("cpu", F64)
    mapping = token_lora_mapping.detach().to("cpu", torch.long)
    A_all, B_all = lora.factors(module)
    out = torch.zeros(x.shape[0], B_all.shape[-2], dtype=F64)
    u_a = ROUNDING_SAFETY * UNIT_ROUNDOFF[act_dtype]
    for slot in sorted({int(v) for v in mapping.tolist() if v >= 0}):
        rows = mapping == slot
        sigma = float(lora.scalings(module)[slot])
        _, err, _ = _delta_terms(x[rows], A_all[slot].to(F64), B_all[slot].to(F64), sigma, u_a, 0.0)
        out[rows] = err
    return out


def _activation_error(g: torch.Tensor, u: torch.Tensor, e_g: torch.Tensor, e_u: torch.Tensor,
                      act: MoEActivation) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [n, I], the error bound of h [n, I]) when g and u are off by at most ``e_g`` and ``e_u``:
    the largest change of the oracle's own activation over each interval, g and u apart (their cross
    term is second order). First order this is ``|∂h/∂g|·e_g + |∂h/∂u|·e_u``; across a clamp it is
    0 strictly inside the clamped region and at most the unclamped slope times the error within
    ``e_g`` of the limit (a rounding can cross it), without a branch on the activation's kind."""
    h = gated_activation(g, u, act)

    def spread(dg, du):
        return torch.maximum((gated_activation(g + dg, u + du, act) - h).abs(),
                             (gated_activation(g - dg, u - du, act) - h).abs())

    return h, spread(e_g, 0.0) + spread(0.0, e_u)


def moe_rounding_scale(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, base: MoEBaseWeights,
                       lora, token_lora_mapping: torch.Tensor, *, act_dtype: torch.dtype,
                       intermediate_dtype: torch.dtype = torch.float32, include_base: bool = False) -> torch.Tensor:
    """The rounding allowance of a MoE layer's output rows (module docstring), float64 on the CPU.

    Args:
        x: [T, H] the layer input. topk_ids: [T, k] (negative: not here; ``[E, E_base)``: base only).
        topk_weights: [T, k].
        base: the block (``MoEBaseWeights``): w_gate_up [E_base, 2I, H] (halves), w_down
            [E_base, H, I], the expert biases b_gate_up [E_base, 2I] and b_down [E_base, H] or None,
            and the activation (SiLU, or GPT-OSS's clamped ``swiglu_oai``).
        lora: the adapters (``LoRAWeights`` or the snapshot's ``PoolView``).
        token_lora_mapping: [T] slot per token (``NO_ADAPTER``: none).
        act_dtype: the activations' dtype (where a backend may round its shrink and delta).
        intermediate_dtype: the dtype ``gate_up_out``, ``h`` and ``down_out`` are stored in.
        include_base: also every pair's base roundings (for the output check, not the delta check).

    Returns:
        [T, H] non-negative: the absolute error a correct run may carry per element.
    """
    # fp8 experts: the roundings are those of the dequantized weights' GEMMs (the quantization steps are
    # the tolerance policy's fp8 rows, not a rounding allowance)
    base = dequantize_moe(base)
    x = x.detach().to("cpu", F64)
    ids = topk_ids.detach().to("cpu", torch.long)
    w = topk_weights.detach().to("cpu", F64)
    mapping = token_lora_mapping.detach().to("cpu", torch.long)
    T, k = ids.shape
    E_base, H = base.w_gate_up.shape[0], base.hidden_size
    E = lora.spec.E
    u_a = ROUNDING_SAFETY * UNIT_ROUNDOFF[act_dtype]
    u_i = ROUNDING_SAFETY * UNIT_ROUNDOFF[intermediate_dtype]
    lam = ACCUMULATION_LAMBDA * UNIT_ROUNDOFF[torch.float32]
    out = torch.zeros(T, H, dtype=F64)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in range(T):
        s = int(mapping[t])
        for j in range(k):
            e = int(ids[t, j])
            if not 0 <= e < E_base:
                continue
            slot = s if (s >= 0 and e < E) else -1
            if slot < 0 and not include_base:
                continue
            groups.setdefault((slot, e), []).append((t, j))
    for (slot, e), pairs in groups.items():
        rows = torch.tensor([t for t, _ in pairs])
        wj = w[rows, torch.tensor([j for _, j in pairs])].abs()[:, None]  # [n, 1]
        X = x[rows]
        # the base GEMMs' stored values, their biases added in fp32 before the one rounding (base_moe)
        gu0 = X @ base.w_gate_up[e].to("cpu", F64).T  # [n, 2I]
        if base.b_gate_up is not None:
            gu0 = gu0 + base.b_gate_up[e].to("cpu", F64)
        g0, u0 = split_gate_up(gu0)  # the harness's own split of gate_up_out's columns
        Wd = base.w_down[e].to("cpu", F64)
        b_d = 0.0 if base.b_down is None else base.b_down[e].to("cpu", F64)
        g, u = g0, u0
        eg, eu = torch.zeros_like(g0), torch.zeros_like(u0)
        lora_pair = slot >= 0
        if lora_pair:
            for name, base_v, err in (("gate", g0, eg), ("up", u0, eu)):
                A, B, sigma = _lora(lora, name, slot, e)
                d, de, _ = _delta_terms(X, A, B, sigma, u_a, lam)
                err += de + u_i * (base_v + d).abs()
                if name == "gate":
                    g = g0 + d
                else:
                    u = u0 + d
        if include_base:
            eg += u_i * g0.abs()
            eu += u_i * u0.abs()
        h, eh = _activation_error(g, u, eg, eu, base.activation)
        h0 = gated_activation(g0, u0, base.activation)
        eh += u_i * (h.abs() + (h0.abs() if lora_pair else 0.0))
        D = Wd.abs()
        eo = torch.zeros(len(pairs), H, dtype=F64)
        out_v = h @ Wd.T + b_d
        if lora_pair:
            A, B, sigma = _lora(lora, "down", slot, e)
            D = D + abs(sigma) * (B.abs() @ A.abs())
            d_o, de_o, _ = _delta_terms(h, A, B, sigma, u_a, lam, input_rounded=intermediate_dtype != act_dtype)
            out_v = out_v + d_o
            out0 = h0 @ Wd.T + b_d
            eo += de_o + lam * ((h.abs() + h0.abs()) @ Wd.abs().T) + (u_i + lam) * (out_v.abs() + out0.abs())
        else:
            eo += lam * (h.abs() @ Wd.abs().T) + (u_i + lam) * out_v.abs()
        # each element of h is rounded on its own: the errors reach the output in ℓ2 through D
        out.index_add_(0, rows, wj * ((eh.square() @ D.square().T).sqrt() + eo))
    return out
