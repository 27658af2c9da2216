"""The rounding allowance of a MoE layer's output and LoRA delta, derived from the actual terms.

A correct backend's MoE delta is not the exact one: fused MoE-LoRA kernels round the shrink output
``A x`` and the delta ``σ·B(A x)`` to the activation dtype (vLLM's fused_moe_lora keeps both in fp16
or bf16), accumulate in fp32, and an engine stores the intermediates (``gate_up_out``, ``h``,
``down_out``) in the model dtype. Under cancellation — a small LoRA delta next to large terms — those
roundings are a large part of the delta: a correct backend rounding its gate_up delta to fp16 failed
the unallowed check at max_rel 4.1e-3 (bound 2e-3) on a one-token case
(``tests/test_suite_moe_rounding.py`` pins it). :func:`moe_rounding_scale` bounds, per output element,
what those roundings can do, to first order, from the case's own values (float64):

For a pair (token t, slot k) with expert e, input x and router weight w, with ``u_a`` the unit
roundoff of the activation dtype, ``u_i`` that of the intermediates' dtype, ``u₃₂`` fp32's, and
``S`` = :data:`ROUNDING_SAFETY`, ``Λ`` = ``λ·u₃₂`` (λ = ``checks.ACCUMULATION_LAMBDA``, the dense
allowance's measured fp32 accumulation multiple):

- gate (and up alike): ``e_g = S·u_a·(|d_g| + σ‖|B| ⊙ |A x|‖₂) + Λ·σ·(‖|B| ⊙ m‖₂ + |B||A x|) + S·u_i·|g|``
  with ``d_g = σ·B(A x)``, ``m_r = Σ_i |A_ri x_i|``, ``g = W_g x + d_g``: the shrink output and the
  delta rounded, their fp32 sums, and ``g`` stored;
- through the activation ``h = silu(g) ⊙ u``: ``e_h = |silu'(g)||u|·e_g + |silu(g)|·e_u + S·u_i·(|h| + |h₀|)``
  (``h₀``: the LoRA-disabled twin's, rounded too);
- through the down projection and its delta: ``|w|·‖D ⊙ e_h‖₂`` per output row, ``D = |W_d| +
  σ_d|B_d||A_d|``, plus the down delta's own roundings (as the gate's, on ``h``, times ``|w|``; where
  ``h`` is handed in fp32, the backend may round it to the activation dtype first: ``u_a·m_d`` more
  per shrink output),
  the fp32 down GEMMs of both runs ``Λ·|w|·|W_d|(|h| + |h₀|)`` and the stored down outputs and their
  top-k sum ``(S·u_i + Λ)·|w|·(|out| + |out₀|)``;
- summed over the token's pairs.

Rounding to nearest is off by at most ``u·|value|`` per rounding; first order, the errors reach the
output through the absolute Jacobians, and since each element is rounded on its own, independent
errors add in ℓ2 (the dense allowance's model: ``checks`` module docstring); ``S = 2`` covers the
second-order terms and the composition of roundings. Measured over 150 draws at the interpret caps
in fp16 (the production-style example backend, ``triton``), the worst error is half the allowance
(``tests/test_suite_moe_rounding.py`` keeps it under 3/4).

Only pairs with LoRA contribute to the *delta* scale (base pairs are bit-identical in the run and
its twin, P02); the *output* scale (``include_base``) adds every pair's base roundings: a small
output next to a large delta carries the delta's roundings too. The price, on well-conditioned
deltas: a median 2.8e-5 of ``|delta|`` per element in fp32 at the interpret caps (3.7e-5 at the dev
caps; a 5e-5 error is still caught on every draw, tested), 8.7e-3 in fp16 (the fp16 bound is 2e-3:
a backend rounding as the fused kernels do carries up to half of that on these draws), 1.7e-2 with
the intermediates in fp16.
"""

from __future__ import annotations

import torch

from moelora_conformance.harness.checks import ACCUMULATION_LAMBDA, UNIT_ROUNDOFF

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


def moe_rounding_scale(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor, lora, token_lora_mapping: torch.Tensor, *, act_dtype: torch.dtype,
                       intermediate_dtype: torch.dtype = torch.float32, include_base: bool = False) -> torch.Tensor:
    """The rounding allowance of a MoE layer's output rows (module docstring), float64 on the CPU.

    Args:
        x: [T, H] the layer input. topk_ids: [T, k] (negative: not here; ``[E, E_base)``: base only).
        topk_weights: [T, k]. w_gate_up: [E_base, 2I, H]. w_down: [E_base, H, I].
        lora: the adapters (``LoRAWeights`` or the snapshot's ``PoolView``).
        token_lora_mapping: [T] slot per token (``NO_ADAPTER``: none).
        act_dtype: the activations' dtype (where a backend may round its shrink and delta).
        intermediate_dtype: the dtype ``gate_up_out``, ``h`` and ``down_out`` are stored in.
        include_base: also every pair's base roundings (for the output check, not the delta check).

    Returns:
        [T, H] non-negative: the absolute error a correct run may carry per element.
    """
    x = x.detach().to("cpu", F64)
    ids = topk_ids.detach().to("cpu", torch.long)
    w = topk_weights.detach().to("cpu", F64)
    mapping = token_lora_mapping.detach().to("cpu", torch.long)
    T, k = ids.shape
    E_base, two_i, H = w_gate_up.shape
    inter = two_i // 2
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
        Wg, Wu, Wd = (w_gate_up[e, :inter].to("cpu", F64), w_gate_up[e, inter:].to("cpu", F64),
                      w_down[e].to("cpu", F64))
        g0, u0 = X @ Wg.T, X @ Wu.T
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
        sig = torch.sigmoid(g)
        silu = g * sig
        dsilu = sig * (1 + g * (1 - sig))
        h, h0 = silu * u, torch.nn.functional.silu(g0) * u0
        eh = dsilu.abs() * u.abs() * eg + silu.abs() * eu
        eh += u_i * (h.abs() + (h0.abs() if lora_pair else 0.0))
        D = Wd.abs()
        eo = torch.zeros(len(pairs), H, dtype=F64)
        out_v = h @ Wd.T
        if lora_pair:
            A, B, sigma = _lora(lora, "down", slot, e)
            D = D + abs(sigma) * (B.abs() @ A.abs())
            d_o, de_o, _ = _delta_terms(h, A, B, sigma, u_a, lam, input_rounded=intermediate_dtype != act_dtype)
            out_v = out_v + d_o
            out0 = h0 @ Wd.T
            eo += de_o + lam * ((h.abs() + h0.abs()) @ Wd.abs().T) + (u_i + lam) * (out_v.abs() + out0.abs())
        else:
            eo += lam * (h.abs() @ Wd.abs().T) + (u_i + lam) * out_v.abs()
        # each element of h is rounded on its own: the errors reach the output in ℓ2 through D
        out.index_add_(0, rows, wj * ((eh.square() @ D.square().T).sqrt() + eo))
    return out
