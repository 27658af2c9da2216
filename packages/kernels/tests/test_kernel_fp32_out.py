"""Half-precision LoRA deltas added into fp32 outputs: the expand epilogues work in fp32 and round once
to the output's dtype, so an fp32 output (e.g. the conformance harness's fp32 MoE intermediates)
keeps the delta unrounded.

Covers: ``moe_lora_delta`` (fused and shrink/expand, both stages), ``virtual_moe_lora_delta`` (the
base grouped GEMM adding into an fp32 ``c``) and the dense expand launchers with an fp16 pool and
fp32 ``out``: equal to the twins fed the same fp32 output, rows the delta must not reach bit for
bit; another output dtype (bf16 for an fp16 pool) is still refused.
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close, launch_guard, randn
from moe_lora_testing import enabled_of, handled, make_pool, twin_delta

from moelora_core import KernelPreconditionError
from moelora_kernels import (
    moe_lora_align_block_size,
    moe_lora_delta,
    segmented_lora_a,
    segmented_lora_b,
    stage_tensors,
    virtual_align,
    virtual_moe_lora_delta,
)
from moelora_reference import sgmv as sgmv_twin

F16, F32 = torch.float16, torch.float32
M, K = 12, 2


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    w = make_pool(seed, dtype=F16, R=8)
    E, H, I = w.spec.E, w.spec.H, w.spec.I
    ids = torch.randint(-1, E, (M, K), generator=gen, dtype=torch.int32).to(DEVICE)
    mapping = torch.tensor([s % 4 - 1 for s in range(M)], dtype=torch.int32, device=DEVICE)  # -1, 0, 1, 2, ...
    return gen, w, E, H, I, ids, mapping


@pytest.mark.parametrize("stage", ["gate_up", "down"])
@pytest.mark.parametrize("path", ["fused", "pair", "virtual"])
def test_moe_lora_delta_adds_into_an_fp32_output(stage, path):
    gen, w, E, H, I, ids, mapping = _problem(3)
    L = w.spec.max_loras
    enabled = enabled_of(mapping, L)
    x = randn(gen, M, H, dtype=F16) if stage == "gate_up" else randn(gen, M * K, I, dtype=F16)
    out0 = randn(gen, M, K, 2 * I if stage == "gate_up" else H, dtype=F32, scale=0.1)
    tw = torch.rand(M, K, generator=gen).to(DEVICE) if stage == "down" else None
    out = out0.clone()
    with launch_guard():
        if path == "virtual":
            _, valign = virtual_align(ids, mapping, E, L, block_m=16)
            virtual_moe_lora_delta(stage, x, out, w, valign, top_k=K, topk_weights=tw)
        else:
            align = moe_lora_align_block_size(ids, mapping, E, 16, L, enabled)
            moe_lora_delta(stage, x, out, w, align, top_k=K, topk_weights=tw, adapter_enabled=enabled,
                           fused=path == "fused")
    align = moe_lora_align_block_size(ids, mapping, E, 16, L, enabled)
    want = twin_delta(stage, x, out0, w, align, K, tw, enabled)
    assert_close(out, want, dtype=F16, what=f"{stage} {path} into fp32", seed=3)
    t = stage_tensors(w, stage)
    mask = handled(stage, ids, mapping, enabled, t["ranks"], E).any(dim=0)
    rows = out.cpu().reshape(M * K, -1)
    before = out0.cpu().reshape(M * K, -1)
    assert_bitwise_equal(rows[~mask], before[~mask], what=f"{stage} {path}: pairs without LoRA", seed=3)


def test_dense_expand_adds_into_an_fp32_output():
    gen, w, *_ = _problem(5)
    spec = w.spec
    A = randn(gen, spec.max_loras, spec.R, 20, dtype=F16)
    B = randn(gen, spec.max_loras, 16, spec.R, dtype=F16)
    ranks = torch.tensor([8, 0, 3], dtype=torch.int32, device=DEVICE)
    scalings = torch.tensor([0.5, 1.0, 2.0], device=DEVICE)
    indptr = torch.tensor([0, 5, 9, 12], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, -1, 2], dtype=torch.int32, device=DEVICE)
    x = randn(gen, M, 20, dtype=F16)
    out0 = randn(gen, M, 16, dtype=F32)
    out = out0.clone()
    with launch_guard():
        t = segmented_lora_a(x, A, indptr, slots, ranks, max_len=5)
        segmented_lora_b(t, B, indptr, slots, ranks, scalings, out, max_len=5)
    want_t = sgmv_twin.segmented_lora_a(x.cpu(), A.cpu(), indptr.cpu(), slots.cpu(), ranks.cpu(), max_len=5)
    want = sgmv_twin.segmented_lora_b(want_t, B.cpu(), indptr.cpu(), slots.cpu(), ranks.cpu(), scalings.cpu(),
                                      out0.cpu().clone(), max_len=5)
    assert_close(out, want, dtype=F16, what="dense expand into fp32", seed=5)
    assert_bitwise_equal(out.cpu()[5:9], out0.cpu()[5:9], what="base segment rows", seed=5)


def test_another_output_dtype_is_refused():
    gen, w, E, H, I, ids, mapping = _problem(7)
    align = moe_lora_align_block_size(ids, mapping, E, 16, w.spec.max_loras)
    out = torch.zeros(M, K, 2 * I, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match="out: dtype bfloat16"):
        moe_lora_delta("gate_up", randn(gen, M, H, dtype=F16), out, w, align, top_k=K)
