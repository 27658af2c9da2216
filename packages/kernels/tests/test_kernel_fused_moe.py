"""The base fused MoE on the Triton kernels against its twin (``moelora_reference.fused_moe``) and the oracle.

Covers: drawn cases (sentinel ids -1, extra fused experts in [E, E_base), one hot expert, empty
experts, top_k 1–2, odd sizes, fp32/fp16 on CPU, bf16 too on a GPU): the gate_up GEMM per pair
(rows of -1 pairs stay NaN), the activation, the down GEMM with router weights, the top-k sum and
the whole layer; the whole layer against the fp64 oracle in fp32; named cases: a single token, all
tokens to one expert, top_k = 1, every id -1, a non-gated GELU layer, NaN in rows of -1 pairs never
reaching y; launcher precondition errors.
"""

import math

import pytest
import torch
from hypothesis import given
from kernel_testing import DEVICE, ON_GPU, assert_bitwise_equal, assert_close, cpu, launch_guard, poisoned, randn

from moelora_conformance.strategies import moe_lora_cases
from moelora_core import KernelPreconditionError
from moelora_kernels import fused_moe, fused_moe_gemm, moe_activation, moe_align_block_size, moe_block_m, moe_sum
from moelora_reference import fused_moe as twin
from moelora_reference.oracle import moe_lora_forward

pytestmark = pytest.mark.interpreter

BASE_CASES = moe_lora_cases(kinds=("extend", "decode", "mixed"))


def _align(ids, E_base, block_m=None):
    M, k = ids.shape
    with launch_guard():
        return moe_align_block_size(ids, E_base, block_m or moe_block_m(M, k, E_base))


@given(case=BASE_CASES)
def test_gate_up_gemm_matches_twin_per_pair(case):
    c = case.materialize(DEVICE)
    M, k = c.topk_ids.shape
    w = c.base.w_gate_up
    align = _align(c.topk_ids, w.shape[0])
    out = poisoned(M * k, w.shape[1], dtype=c.x.dtype)
    with launch_guard():
        fused_moe_gemm(c.x, w, out, align, top_k=k, num_pairs=M * k, in_row_div=k)
    want = twin.fused_moe_gemm(c.x, w, torch.full_like(out, float("nan")), align, top_k=k,
                               num_pairs=M * k, in_row_div=k)
    here = (c.topk_ids >= 0).reshape(-1).cpu()
    assert_close(out.cpu()[here], want.cpu()[here], dtype=c.x.dtype, what="gate_up per pair", seed=case.seed)
    assert bool(out.cpu()[~here].isnan().all()), f"rows of EXPERT_NOT_HERE pairs were written (seed={case.seed})"


@given(case=BASE_CASES)
def test_fused_moe_layer_matches_twin(case):
    c = case.materialize(DEVICE)
    align = _align(c.topk_ids, c.base.w_gate_up.shape[0])
    with launch_guard():
        y = fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down, align=align)
    want = twin.fused_moe(c.x, c.topk_ids, c.topk_weights, c.base.w_gate_up, c.base.w_down, align)
    assert_close(y, want, dtype=c.x.dtype, what="fused_moe y", seed=case.seed)
    if c.x.dtype == torch.float32 and c.x.shape[0] <= 96:
        oracle = moe_lora_forward(cpu(c.x), cpu(c.topk_ids), cpu(c.topk_weights), cpu(c.base.w_gate_up),
                                  cpu(c.base.w_down), None, None)
        assert_close(y, oracle, dtype=torch.float32, what="fused_moe y vs oracle", seed=case.seed)


def _problem(seed, M, k, E_base, H=40, I=24, dtype=torch.float32, ids=None, gated=True):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, M, H, dtype=dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E_base, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    weights = torch.rand(M, k, generator=gen).to(DEVICE)
    w_gate_up = randn(gen, E_base, (2 if gated else 1) * I, H, dtype=dtype, scale=1 / math.sqrt(H))
    w_down = randn(gen, E_base, H, I, dtype=dtype, scale=1 / math.sqrt(I))
    return x, ids.to(DEVICE), weights, w_gate_up, w_down


@pytest.mark.parametrize("name, M, k, E_base, ids", [
    ("single token", 1, 2, 5, None),                                  # T < BLOCK_M
    ("all tokens to one expert", 70, 1, 4, torch.full((70, 1), 2, dtype=torch.int32)),  # several blocks, one expert
    ("top_k = 1", 33, 1, 6, None),                                    # shape guessing by top_k breaks here
    ("every id -1", 5, 2, 3, torch.full((5, 2), -1, dtype=torch.int32)),  # y must be exactly 0
    ("extra fused expert only", 9, 1, 3, torch.full((9, 1), 2, dtype=torch.int32)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_named_base_cases(name, M, k, E_base, ids, dtype):
    x, ids, weights, w_gu, w_d = _problem(7, M, k, E_base, dtype=dtype, ids=ids)
    align = _align(ids, E_base)
    with launch_guard():
        y = fused_moe(x, ids, weights, w_gu, w_d, align=align)
    want = twin.fused_moe(x, ids, weights, w_gu, w_d, align)
    if name == "every id -1":
        assert_bitwise_equal(y, torch.zeros_like(y), what=name)
    else:
        assert_close(y, want, dtype=dtype, what=name, seed=7)


@pytest.mark.parametrize("block_m", [64, 128])
def test_table_block_m_against_the_oracle(block_m):
    """The base alignment's larger blocks (``configs.moe_block_m(op="moe_align_block_size")``: 128 in the
    H100 table above 8192 rows), checked here at small shapes: a block holds rows of one expert and
    padding, 150 tokens over 3 experts fill a 128-row block and spill into a second."""
    x, ids, weights, w_gu, w_d = _problem(11, 150, 2, 3)
    align = _align(ids, 3, block_m)
    with launch_guard():
        y = fused_moe(x, ids, weights, w_gu, w_d, align=align)
    oracle = moe_lora_forward(cpu(x), cpu(ids), cpu(weights), cpu(w_gu), cpu(w_d), None, None)
    assert_close(y, oracle, dtype=torch.float32, what=f"fused_moe y at BLOCK_M {block_m} vs oracle", seed=11)


@pytest.mark.parametrize("group", [1, 2, 3, 64])
def test_group_size_m_renumbers_programs_and_changes_no_bit(group):
    """``GROUP_SIZE_M`` (the base GEMM's program order for L2 reuse) only renumbers programs: every
    (row block, column tile) is computed once, so the output equals launch order's bit for bit, rows of
    -1 pairs stay NaN, and a last group smaller than ``group`` loses no block."""
    x, ids, _, w_gu, _ = _problem(12, 100, 2, 4, H=40, I=48)
    ids[::9, 1] = -1  # some pairs routed nowhere
    align = _align(ids, 4, 32)
    M, k = ids.shape
    outs = {}
    for g in (0, group):
        out = poisoned(M * k, w_gu.shape[1], dtype=x.dtype)
        with launch_guard():
            fused_moe_gemm(x, w_gu, out, align, top_k=k, num_pairs=M * k, in_row_div=k,
                           config={"GROUP_SIZE_M": g})
        outs[g] = out.cpu()
    here = (ids >= 0).reshape(-1).cpu()
    assert bool(outs[group][~here].isnan().all()), "rows of EXPERT_NOT_HERE pairs were written"
    assert not bool(outs[group][here].isnan().any()), f"GROUP_SIZE_M {group}: a (block, tile) was not computed"
    assert_bitwise_equal(outs[group], outs[0], what=f"GROUP_SIZE_M {group} vs launch order")
    want = twin.fused_moe_gemm(x, w_gu, torch.full_like(outs[0], float("nan")).to(DEVICE), align, top_k=k,
                               num_pairs=M * k, in_row_div=k)
    assert_close(outs[group][here], want.cpu()[here], dtype=x.dtype, what="gate_up per pair", seed=12)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("gated", [True, False])
def test_activation_variants(activation, gated):
    x, ids, weights, w_gu, w_d = _problem(8, 21, 2, 4, gated=gated)
    align = _align(ids, 4)
    with launch_guard():
        y = fused_moe(x, ids, weights, w_gu, w_d, align=align, activation=activation, gated=gated)
    want = twin.fused_moe(x, ids, weights, w_gu, w_d, align, activation=activation,
                          gated=gated)
    assert_close(y, want, dtype=torch.float32, what=f"{activation} gated={gated}", seed=8)


def test_moe_sum_never_reads_rows_of_expert_not_here():
    # rows of -1 pairs are never written by the GEMM: NaN there must not reach y
    gen = torch.Generator().manual_seed(9)
    down = randn(gen, 6, 3, 16, dtype=torch.float16)
    ids = torch.tensor([[0, -1, 2]] * 6, dtype=torch.int32, device=DEVICE)
    down[:, 1] = float("nan")
    with launch_guard():
        y = moe_sum(down, ids)
    assert_close(y, twin.moe_sum(down, ids), dtype=torch.float16, what="moe_sum", seed=9)


@pytest.mark.parametrize("call, match", [
    (lambda x, w, c, a: fused_moe_gemm(x.half(), w, c, a, top_k=2, num_pairs=8, in_row_div=2), "w: dtype"),
    (lambda x, w, c, a: fused_moe_gemm(x, w[:, :, :-1], c, a, top_k=2, num_pairs=8, in_row_div=2), "reduction size"),
    (lambda x, w, c, a: fused_moe_gemm(x, w, c[:-1], a, top_k=2, num_pairs=8, in_row_div=2), "c: expected shape"),
    (lambda x, w, c, a: fused_moe_gemm(x.t(), w, c, a, top_k=2, num_pairs=8, in_row_div=2), "stride 1"),
    (lambda x, w, c, a: fused_moe_gemm(x[:3], w, c, a, top_k=2, num_pairs=8, in_row_div=2), "cannot serve"),
    (lambda x, w, c, a: fused_moe_gemm(x, w, c, a, top_k=2, num_pairs=8, in_row_div=2,
                                       topk_weights=torch.ones(7, device=DEVICE)), "topk_weights"),
    (lambda x, w, c, a: fused_moe_gemm(x, w, c, a, top_k=2, num_pairs=8, in_row_div=2,
                                       config={"GROUP_SIZE_M": -1}), "GROUP_SIZE_M"),
    (lambda x, w, c, a: moe_activation(c[:, :5]), "even width"),
    (lambda x, w, c, a: moe_activation(c, activation="relu"), "activation"),
])
def test_launcher_refuses_bad_arguments(call, match):
    x, ids, _, w, _ = _problem(10, 4, 2, 3, H=16, I=16)
    a = _align(ids, 3, 16)
    c = torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match=match):
        call(x, w, c, a)


@pytest.mark.skipif(not ON_GPU, reason="bf16 math needs a GPU (the interpreter computes bf16 wrongly)")
@pytest.mark.gpu
@pytest.mark.bf16
def test_bf16_layer_on_gpu():
    x, ids, weights, w_gu, w_d = _problem(11, 300, 2, 6, H=128, I=96, dtype=torch.bfloat16)
    align = _align(ids, 6)
    with launch_guard():
        y = fused_moe(x, ids, weights, w_gu, w_d, align=align)
    want = twin.fused_moe(x, ids, weights, w_gu, w_d, align)
    assert_close(y, want, dtype=torch.bfloat16, what="bf16 fused_moe", seed=11)
