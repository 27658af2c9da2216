"""GPT-OSS's expert tensors and its PEFT ``target_parameters`` factors in moelora's layout (DESIGN.md §1).

transformers 5.17 ``GptOssExperts`` stores, per layer (E experts, H hidden, I expert width):

==========================  ============  ===================================================
key (under mlp.experts.)    shape         meaning
==========================  ============  ===================================================
gate_up_proj                [E, H, 2I]    ``z = x @ W + b``; gate = z[..., 0::2], up = z[..., 1::2]
gate_up_proj_bias           [E, 2I]       interleaved like the columns
down_proj                   [E, I, H]     ``y = h @ W + b``
down_proj_bias              [E, H]
==========================  ============  ===================================================

and the router ``mlp.router.weight`` [E, H], ``mlp.router.bias`` [E].

A PEFT adapter with ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``
(peft 0.21.2 ``ParamWrapper`` on a 3-D parameter with ``is_transposed``: in = dim 1, out = dim 2)
saves ``...mlp.experts.lora_A.weight`` [E·r, in] (expert-major: expert e = rows [e·r, (e+1)·r)) and
``...mlp.experts.lora_B.weight`` [out, r·E] (rank-major: expert e = columns e, E + e, 2E + e, ...),
with ΔW[e] = σ · (B_e A_e)ᵀ added to W[e]. For gate_up the out axis is interleaved, so moelora's
gate B is B_e[0::2] and up B is B_e[1::2]; both share A_e (rank r each, σ of the one module).
"""

from __future__ import annotations

import torch

from moelora_core.errors import InvalidFieldError


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[.., 2I] interleaved (gate 2i, up 2i + 1) → [.., 2I] halves (gate [:I], up [I:])."""
    if t.shape[-1] % 2:
        raise InvalidFieldError("gate_up", f"interleaved gate/up needs an even last dim, got {tuple(t.shape)}")
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def gpt_oss_experts(
    gate_up_proj: torch.Tensor, gate_up_bias: torch.Tensor, down_proj: torch.Tensor, down_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-OSS expert tensors (module table) → (w_gate_up [E, 2I, H] halves, b_gate_up [E, 2I] halves,
    w_down [E, H, I], b_down [E, H]), contiguous, dtype kept.

    Raises:
        InvalidFieldError: shapes that do not fit together.
    """
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] % 2:
        raise InvalidFieldError("gate_up_proj", f"expected [E, H, 2I], got {tuple(gate_up_proj.shape)}")
    E, H, two_i = gate_up_proj.shape
    expected = {
        "gate_up_proj_bias": (gate_up_bias, (E, two_i)),
        "down_proj": (down_proj, (E, two_i // 2, H)),
        "down_proj_bias": (down_bias, (E, H)),
    }
    for name, (value, shape) in expected.items():
        if tuple(value.shape) != shape:
            raise InvalidFieldError(name, f"expected {shape}, got {tuple(value.shape)}")
    w_gate_up = deinterleave(gate_up_proj).transpose(1, 2).contiguous()  # [E, 2I, H]
    return (
        w_gate_up,
        deinterleave(gate_up_bias).contiguous(),
        down_proj.transpose(1, 2).contiguous(),
        down_bias.contiguous(),
    )


def gpt_oss_lora_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT ``ParamWrapper`` factors of one 3-D expert parameter → per-expert (A [E, r, in], B [E, out, r]).

    Args:
        lora_a: ``lora_A.weight`` [E·r, in]. lora_b: ``lora_B.weight`` [out, r·E]. num_experts: E.

    Raises:
        InvalidFieldError: rows of A or columns of B not a multiple of E, or ranks that differ.
    """
    E = num_experts
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] % E or lora_b.shape[1] % E:
        raise InvalidFieldError(
            "lora_A/lora_B",
            f"expected [E·r, in] and [out, r·E] with E={E}, got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}",
        )
    r = lora_a.shape[0] // E
    if lora_b.shape[1] // E != r:
        raise InvalidFieldError("lora_B", f"rank {lora_b.shape[1] // E} != lora_A's rank {r}")
    a = lora_a.reshape(E, r, lora_a.shape[1])  # expert-major rows
    b = lora_b.reshape(lora_b.shape[0], r, E).permute(2, 0, 1)  # rank-major columns → [E, out, r]
    return a.contiguous(), b.contiguous()


def split_gate_up_lora(a: torch.Tensor, b: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """gate_up factors (A [E, r, H], B [E, 2I, r], interleaved out) → {"gate": (A, B[:, 0::2]),
    "up": (A, B[:, 1::2])}: the delta of column 2i is gate row i's, of column 2i + 1 up row i's."""
    return {"gate": (a, b[:, 0::2].contiguous()), "up": (a, b[:, 1::2].contiguous())}
