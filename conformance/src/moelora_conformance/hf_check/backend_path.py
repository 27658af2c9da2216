"""Readers → ``load_adapter_into_slot`` → the reference backend, against HF + PEFT (``docs/checkpoints.md``).

One mixed EXTEND batch per layer: request 0 uses the adapter (slot ``SLOT``), request 1 is a base
request. The backend's fused ``moe_forward`` and ``dense_delta`` (added to the base projection)
must give, on request 0's rows, the HF+PEFT output with the adapter and, on request 1's rows, the
HF output without it (fp32, max and RMS relative error <= 1e-5). With a shared expert (Qwen2-MoE)
the MoE row adds ``moelora_core.shared_expert_forward`` on the backend's dense path (base GEMM +
``dense_delta`` for shared_gate / shared_up / shared_down), the engine's composition.
"""

from __future__ import annotations

import torch

from moelora_conformance.hf_check.compare import SLOT, TOKENS, CheckRow
from moelora_core import (
    DEFAULT_POLICY,
    NO_ADAPTER,
    BatchSpec,
    ForwardMode,
    LoRAWeights,
    MoEBaseWeights,
    Request,
    SharedExpertWeights,
    shared_expert_forward,
)

#: Rows of the adapter request; the rest of the batch is the base request.
ADAPTER_TOKENS = 20


def compare_backend_layer(
    *,
    model: str,
    adapter: str,
    layer: int,
    moe: MoEBaseWeights | None,
    dense: dict[str, torch.Tensor],
    pool: LoRAWeights,
    lora_side: dict,
    base_side: dict,
    seed: int,
    shared: SharedExpertWeights | None = None,
    dense_bias: dict[str, torch.Tensor] | None = None,
) -> list[CheckRow]:
    """Rows "moe", "moe base rows" and, per dense module, "<m>" and "<m> base rows".

    Args:
        lora_side / base_side: ``hf_moe(x)`` and ``hf_dense(m, x)`` with and without the adapter.
    """
    from moelora_reference.backend import make_backend
    from moelora_reference.routing import route

    backend = make_backend(pool.spec)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(SLOT, ADAPTER_TOKENS), Request(NO_ADAPTER, TOKENS - ADAPTER_TOKENS)],
                      pool.spec.max_loras, pool.slot_ranks(), pool.slot_scalings())
    info = backend.prepare(batch)
    gen = torch.Generator().manual_seed(seed)
    a = slice(0, ADAPTER_TOKENS)
    b = slice(ADAPTER_TOKENS, TOKENS)
    rows: list[CheckRow] = []

    def row(part: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        rep = DEFAULT_POLICY.check(actual, expected, dtype=torch.float32, what=f"{model}/{adapter} L{layer} {part}",
                                   seed=seed)
        rows.append(CheckRow(model, adapter, "reference-backend", layer, part, rep.max_rel, rep.rms_rel, None,
                             rep.ok, "equal", "" if rep.ok else rep.message()))

    x = torch.randn(TOKENS, pool.spec.hidden_size, generator=gen)
    if moe is not None:
        weights, ids = route(x, pool.spec.top_k, moe)
        y = backend.moe_forward(x, ids, weights, moe, pool, info)
    else:  # DeepSeek-V3's dense layers: the dense MLP alone (in ``shared``), row "mlp"
        y = torch.zeros_like(x)
    if shared is not None:
        def project(module: str, xm: torch.Tensor) -> torch.Tensor:
            out = xm @ shared.dense(module).T
            backend.dense_delta(module, xm, out, pool, info)
            return out

        y = y + shared_expert_forward(x, shared, project)
    part = "moe" if moe is not None else "mlp"
    row(part, y[a], lora_side["hf_moe"](x[a]))
    row(f"{part} base rows", y[b], base_side["hf_moe"](x[b]))
    for m, w in dense.items():
        xd = torch.randn(TOKENS, w.shape[1], generator=gen)
        out = xd @ w.T
        if dense_bias and m in dense_bias:  # the base projection's bias (Qwen2-MoE q/k/v), before the delta
            out = out + dense_bias[m]
        backend.dense_delta(m, xd, out, pool, info)
        row(m, out[a], lora_side["hf_dense"](m, xd[a]))
        row(f"{m} base rows", out[b], base_side["hf_dense"](m, xd[b]))
    return rows
