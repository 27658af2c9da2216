"""GPT-OSS's MoE block on the Triton kernels: the epilogue's activation parameters and the base
GEMMs' expert biases, against the twins (``moelora_reference.fused_moe`` / ``moe_lora_ops``) and the
fp64 oracle (DESIGN.md §1). The readers de-interleave the checkpoint's gate/up columns at load, so
the kernels see gate/up in halves.

Covers (drawn cases of the suite's strategies, with expert biases and inputs scaled so GPT-OSS's
clamp at ``limit`` binds): the ``swiglu_oai`` activation epilogue (rows of -1 pairs left unwritten);
the gate_up and down GEMMs with biases (the down bias router-weighted); the whole layer with MoE
LoRA against the oracle; named cases: the clamp binds (``test_the_clamp_binds_in_the_kernel``);
launcher refusals (swiglu_oai without gating, a bias of the wrong shape).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_close, cpu, launch_guard, poisoned, randn
from moe_lora_testing import cpu_weights

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import KernelPreconditionError
from moelora_core.moe_activation import SWIGLU_OAI
from moelora_kernels import (
    MoELoRAInputs,
    fused_moe,
    fused_moe_gemm,
    moe_activation,
    moe_align_block_size,
    moe_block_m,
    moe_lora_align_block_size,
)
from moelora_reference import fused_moe as twin
from moelora_reference.oracle import moe_lora_forward

pytestmark = pytest.mark.interpreter

LIMIT, ALPHA = SWIGLU_OAI.limit, SWIGLU_OAI.alpha
CASES = moe_lora_cases(kinds=("extend", "decode", "mixed"), virtual_experts=False)
# The float64 loop oracle runs on the CPU: bound its sizes whatever the profile (as test_kernel_moe_lora).
ORACLE_CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def _biases(seed, E_base, I, H, dtype):
    gen = torch.Generator().manual_seed(seed + 1)
    return randn(gen, E_base, 2 * I, dtype=dtype, scale=0.5), randn(gen, E_base, H, dtype=dtype, scale=0.5)


def _clamping(gate_up: torch.Tensor) -> torch.Tensor:
    """Rows scaled so some gate values pass +limit and some up values pass ±limit."""
    return gate_up * (2.5 * LIMIT / max(float(gate_up.abs().max()), 1e-3))


@given(case=CASES)
def test_swiglu_oai_epilogue_matches_twin(case):
    c = case.materialize(DEVICE)
    M, k = c.topk_ids.shape
    I = c.base.w_down.shape[2]
    gen = torch.Generator().manual_seed(case.seed)
    gate_up = _clamping(randn(gen, M * k, 2 * I, dtype=c.x.dtype))
    h = poisoned(M * k, I, dtype=c.x.dtype)
    with launch_guard():
        moe_activation(
            gate_up, activation="swiglu_oai", topk_ids=c.topk_ids, out=h, alpha=ALPHA, limit=LIMIT
        )
    want = twin.moe_activation(gate_up, activation="swiglu_oai", alpha=ALPHA, limit=LIMIT)
    here = (c.topk_ids >= 0).reshape(-1).cpu()
    assert_close(h.cpu()[here], want.cpu()[here], dtype=c.x.dtype, what="swiglu_oai", seed=case.seed)
    assert bool(h.cpu()[~here].isnan().all()), f"h rows of EXPERT_NOT_HERE pairs written (seed={case.seed})"


@given(case=CASES, stage=st.sampled_from(("gate_up", "down")))
def test_gemm_with_expert_bias_matches_twin(case, stage):
    c = case.materialize(DEVICE)
    M, k = c.topk_ids.shape
    E_base, H, I = c.base.w_down.shape
    b_gu, b_d = _biases(case.seed, E_base, I, H, c.x.dtype)
    with launch_guard():
        align = moe_align_block_size(c.topk_ids, E_base, moe_block_m(M, k, E_base))
    gen = torch.Generator().manual_seed(case.seed)
    if stage == "gate_up":
        a, w, bias, div, tw = c.x, c.base.w_gate_up, b_gu, k, None
    else:
        a, w, bias, div, tw = randn(gen, M * k, I, dtype=c.x.dtype), c.base.w_down, b_d, 1, c.topk_weights
    out = poisoned(M * k, w.shape[1], dtype=c.x.dtype)
    with launch_guard():
        fused_moe_gemm(a, w, out, align, top_k=k, num_pairs=M * k, in_row_div=div, topk_weights=tw, bias=bias)
    want = twin.fused_moe_gemm(
        a,
        w,
        torch.full_like(out, float("nan")),
        align,
        top_k=k,
        num_pairs=M * k,
        in_row_div=div,
        topk_weights=tw,
        bias=bias,
    )
    here = (c.topk_ids >= 0).reshape(-1).cpu()
    assert_close(out.cpu()[here], want.cpu()[here], dtype=c.x.dtype, what=f"{stage} + bias", seed=case.seed)
    assert bool(out.cpu()[~here].isnan().all()), f"rows of EXPERT_NOT_HERE pairs written (seed={case.seed})"


def _gpt_oss_layer(c, seed):
    """(x, weights and biases as the readers leave them: gate/up in halves) of a case, x scaled so the
    clamp binds."""
    E_base, H, I = c.base.w_down.shape
    b_gu, b_d = _biases(seed, E_base, I, H, c.x.dtype)
    x = c.x * 4.0
    return x, (c.base.w_gate_up, b_gu, c.base.w_down, b_d)


@given(
    case=moe_lora_cases(ORACLE_CAPS, kinds=("extend", "decode", "mixed"), virtual_experts=False, dtype=torch.float32)
)
def test_gpt_oss_layer_with_lora_matches_oracle(case):
    c = case.materialize(DEVICE)
    spec = c.spec
    M, k = c.topk_ids.shape
    x, (w_gu, b_gu, w_d, b_d) = _gpt_oss_layer(c, case.seed)
    with launch_guard():
        align = moe_lora_align_block_size(
            c.topk_ids, c.token_lora_mapping, spec.E, moe_block_m(M, k, spec.E, spec.max_loras), spec.max_loras
        )
        y = fused_moe(
            x,
            c.topk_ids,
            c.topk_weights,
            w_gu,
            w_d,
            activation="swiglu_oai",
            b_gate_up=b_gu,
            b_down=b_d,
            alpha=ALPHA,
            limit=LIMIT,
            deltas=MoELoRAInputs(c.lora, align),
        )
    want = moe_lora_forward(
        cpu(x),
        cpu(c.topk_ids),
        cpu(c.topk_weights),
        cpu(w_gu),
        cpu(w_d),
        cpu_weights(c.lora),
        cpu(c.token_lora_mapping),
        b_gate_up=cpu(b_gu),
        b_down=cpu(b_d),
        activation=SWIGLU_OAI,
    )
    assert_close(y, want, dtype=torch.float32, what="GPT-OSS layer (kernels) vs oracle", seed=case.seed)
    twin_y = twin.fused_moe(
        x,
        c.topk_ids,
        c.topk_weights,
        w_gu,
        w_d,
        moe_align_block_size(c.topk_ids, w_d.shape[0], moe_block_m(M, k, w_d.shape[0])),
        activation="swiglu_oai",
        b_gate_up=b_gu,
        b_down=b_d,
        alpha=ALPHA,
        limit=LIMIT,
    )
    base = moe_lora_forward(
        cpu(x),
        cpu(c.topk_ids),
        cpu(c.topk_weights),
        cpu(w_gu),
        cpu(w_d),
        None,
        None,
        b_gate_up=cpu(b_gu),
        b_down=cpu(b_d),
        activation=SWIGLU_OAI,
    )
    assert_close(twin_y, base, dtype=torch.float32, what="GPT-OSS twin base vs oracle", seed=case.seed)


# --- named cases -----------------------------------------------------------------------------------


def test_the_clamp_binds_in_the_kernel():
    gen = torch.Generator().manual_seed(5)
    gate_up = _clamping(randn(gen, 16, 48, dtype=torch.float32))
    g, u = gate_up[:, :24], gate_up[:, 24:]
    assert bool((g > LIMIT).any()) and bool((u.abs() > LIMIT).any())
    with launch_guard():
        h = moe_activation(gate_up, activation="swiglu_oai", alpha=ALPHA, limit=LIMIT)
        unclamped = moe_activation(gate_up, activation="swiglu_oai", alpha=ALPHA, limit=1e9)
    assert_close(
        h,
        twin.moe_activation(gate_up, activation="swiglu_oai"),
        dtype=torch.float32,
        what="swiglu_oai",
    )
    assert not torch.allclose(h, unclamped), "limit has no effect on values past it"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda gu, w, a: moe_activation(gu[:, :24], activation="swiglu_oai", gated=False), "gated"),
        (lambda gu, w, a: moe_activation(gu, activation="swiglu_oai", limit=0.0), "limit"),
        (
            lambda gu, w, a: fused_moe_gemm(
                gu[:, :40],
                w,
                torch.empty(4, 48, device=DEVICE),
                a,
                top_k=1,
                num_pairs=4,
                in_row_div=1,
                bias=torch.zeros(3, 47, device=DEVICE),
            ),
            "bias",
        ),
    ],
)
def test_launcher_refusals(call, match):
    gen = torch.Generator().manual_seed(0)
    gu = randn(gen, 4, 48, dtype=torch.float32)
    w = randn(gen, 3, 48, 40, dtype=torch.float32)
    with launch_guard():
        a = moe_align_block_size(torch.zeros(4, 1, dtype=torch.int32, device=DEVICE), 3, 16)
    with pytest.raises(KernelPreconditionError, match=match):
        call(gu, w, a)
