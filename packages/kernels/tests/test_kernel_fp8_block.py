"""fp8 block-scaled w8a8 kernels (``moelora_kernels.fp8_block``) against their twins and the oracle
(DESIGN.md §1, "Quantized base").

Covers: the activation quantization bit for bit against its twin (fp32 and fp16 inputs; every e4m3
value and tie, subnormals, an all-zero group, a value at amax that would overflow an unclamped
quotient, a partial last group); the fp8 grouped GEMM per pair against its float64 twin on the same
quantized input (gate_up with gate's and up's scale grids and partial row blocks; down with router
weights; rows of -1 pairs stay NaN); the whole w8a8 layer with deltas against the oracle under the fp8
rows, its base rows bit-identical to the layer without deltas, the deltas reading the unquantized
activations (the oracle's LoRA term); K-groups narrower than a dot step or not a power of two (the
tiny fixtures' blocks 4 and 8 run on a GPU's base path too); precondition errors (a block that is not a
positive int, a mis-shaped scale grid).
"""

import math

import pytest
import torch
from kernel_testing import (
    DEVICE,
    H200_MAX_SHARED,
    assert_bitwise_equal,
    assert_close,
    compile_for_h200,
    launch_guard,
    poisoned,
    qwen3_fp8_gemm_case,
)

from moelora_core import DEFAULT_POLICY, KernelPreconditionError, LoRALayerSpec, LoRAWeights, ModuleLoRA, MoEBaseWeights
from moelora_core.fp8_block import quantize_weight_fp8_block
from moelora_kernels import moe_align_block_size, moe_block_m
from moelora_kernels.fp8_block import fp8_moe_gemm, k_tile, quantize_activation_fp8
from moelora_kernels.moe_forward import fused_moe
from moelora_reference import fp8_block as twin
from moelora_reference.base_moe import route_topk
from moelora_reference.oracle import moe_block_forward

pytestmark = pytest.mark.interpreter
DTYPES = [torch.float32, torch.float16]  # the interpreter's bf16 math is wrong (CPU tests: fp32 / fp16)


def _codes() -> torch.Tensor:
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique().sort().values
    return torch.cat([vals, (vals[1:] + vals[:-1]) / 2])  # every e4m3 value and every tie


@pytest.mark.parametrize("quant_rows", [1, 4, 16])  # 4: a partial last program of rows; 16: one program
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantization_is_bit_identical_to_the_twin(dtype, quant_rows):
    gen = torch.Generator().manual_seed(0)
    codes = _codes()
    x = torch.zeros(6, 48)
    x[0, :16] = 448.0  # group of 448 → scale 1: the rows below land on the values and ties as they are
    x[0, 16:48] = codes[torch.randint(0, codes.numel(), (32,), generator=gen)]
    x[1] = torch.randn(48, generator=gen) * torch.logspace(-7, 2, 48)  # subnormal e4m3 codes in a group
    x[2, :16] = 0.0  # an all-zero group: the eps floor, zeros
    x[3] = torch.randn(48, generator=gen) * 50
    x[4, 5] = 464.0  # amax of its group: x / s rounds near 448, the clamp keeps it finite
    x[5] = -torch.rand(48, generator=gen)
    x[5, 3], x[5, 20] = -1e-6, -0.0  # a negative value that rounds to zero keeps its sign; -0 gives +0, as the twin
    x = x.to(dtype).to(DEVICE)
    for K in (48, 40):  # 40: a partial last group of 8
        with launch_guard():
            q, s = quantize_activation_fp8(x[:, :K].contiguous(), 16, config={"QUANT_ROWS": quant_rows})
        q2, s2 = twin.quantize_activation(x[:, :K].cpu(), 16)
        assert_bitwise_equal(q.float().cpu(), q2, what=f"q K={K} {dtype}")
        assert_bitwise_equal(s.cpu(), s2, what=f"s K={K} {dtype}")
        assert bool(torch.isfinite(q.float()).all())


def _fp8_case(dtype, T=9, H=40, inter=24, E=4, k=2, r=4, block=(16, 16), seed=3):
    gen = torch.Generator().manual_seed(seed)
    qg, sg = quantize_weight_fp8_block(torch.randn(E, inter, H, generator=gen) / math.sqrt(H), block)
    qu, su = quantize_weight_fp8_block(torch.randn(E, inter, H, generator=gen) / math.sqrt(H), block)
    qd, sd = quantize_weight_fp8_block(torch.randn(E, H, inter, generator=gen) / math.sqrt(inter), block)
    base = MoEBaseWeights(torch.cat([qg, qu], 1), qd, weight_block=block,
                          w_gate_up_scale_inv=torch.cat([sg, su], 1), w_down_scale_inv=sd)
    pool = LoRAWeights(LoRALayerSpec(H, inter, E, k, {}, 2, r, dtype=dtype, base_quant="fp8_block"))
    pool.load_slot(1, {m: ModuleLoRA(torch.randn(E, r, i, generator=gen) / math.sqrt(i),
                                     torch.randn(E, o, r, generator=gen) / math.sqrt(r), 0.75)
                       for m, (i, o) in (("gate", (H, inter)), ("up", (H, inter)), ("down", (inter, H)))})
    x = torch.randn(T, H, generator=gen).to(dtype)
    weights, ids = route_topk(torch.randn(T, E, generator=gen), k, True)
    ids[2, 1] = -1  # a pair handled elsewhere: nothing, base or LoRA
    mapping = torch.tensor([1, -1, 1, 1, -1, 1, -1, 1, 1][:T], dtype=torch.int32)
    return base, pool, x, ids, weights, mapping


# bk 32 and 24 (padded to 32): the tensor cores' fp8 dot on a GPU; bk 8, 4, 12: a group narrower than a dot
# step (the e2e fixtures' blocks), padded with masked zeros
@pytest.mark.parametrize("block", [(16, 16), (16, 32), (16, 24), (8, 8), (8, 4), (16, 12)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemm_matches_its_twin_per_pair(dtype, block):
    base, _, x, ids, weights, _ = _fp8_case(dtype, H=72, block=block)  # H = 72: a partial last K-group
    M, k = ids.shape
    E, width, H = base.w_gate_up.shape
    # inputs staged before the launch guard: a host-to-device copy inside it counts as a host sync
    d_ids, d_x, d_w, d_ws = (t.to(DEVICE) for t in (ids, x, base.w_gate_up, base.w_gate_up_scale_inv))
    with launch_guard():
        align = moe_align_block_size(d_ids, E, moe_block_m(M, k, E))
        q, s = quantize_activation_fp8(d_x, block[1])
        gate_up = fp8_moe_gemm(q, s, d_w, d_ws,
                               poisoned(M * k, width, dtype=dtype), align, block=block, top_k=k, num_pairs=M * k,
                               in_row_div=k, half=width // 2)
    cpu_align = type(align)(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in align))
    want = twin.fp8_moe_gemm(q.float().cpu(), s.cpu(), base.w_gate_up, base.w_gate_up_scale_inv,
                             torch.full((M * k, width), float("nan"), dtype=dtype), cpu_align, block=block,
                             top_k=k, num_pairs=M * k, in_row_div=k, half=width // 2)
    here = (ids >= 0).reshape(-1)
    assert_close(gate_up.cpu()[here], want[here], dtype=dtype, what="fp8 gate_up per pair")
    assert bool(gate_up.cpu()[~here].isnan().all())
    h = torch.randn(M * k, width // 2, generator=torch.Generator().manual_seed(4)).to(dtype)
    d_h, d_w, d_ws, d_tw = (t.to(DEVICE) for t in (h, base.w_down, base.w_down_scale_inv,
                                                     weights.reshape(-1).contiguous()))
    with launch_guard():
        qh, sh = quantize_activation_fp8(d_h, block[1])
        down = fp8_moe_gemm(qh, sh, d_w, d_ws, poisoned(M * k, H, dtype=dtype),
                            align, block=block, top_k=k, num_pairs=M * k, in_row_div=1, topk_weights=d_tw)
    want = twin.fp8_moe_gemm(qh.float().cpu(), sh.cpu(), base.w_down, base.w_down_scale_inv,
                             torch.full((M * k, H), float("nan"), dtype=dtype), cpu_align, block=block, top_k=k,
                             num_pairs=M * k, in_row_div=1, topk_weights=weights.reshape(-1))
    assert_close(down.cpu()[here], want[here], dtype=dtype, what="fp8 down per pair")


class _TorchDeltas:
    """The LoRA deltas in fp32 torch (rounded once into the output), reading the activations given.

    Everything a call reads is staged on ``device`` at construction (before the launch guard): the calls do
    device arithmetic only, indexed by host ints, so nothing in them synchronizes under the guard."""

    def __init__(self, pool, mapping, ids, device):
        self.mapping, self.ids = mapping.tolist(), ids.tolist()
        self.f = {m: tuple(f.float().to(device) for f in pool.factors(m)) for m in ("gate", "up", "down")}
        self.sigma = {m: pool.scalings(m).tolist() for m in ("gate", "up", "down")}

    def _delta(self, m, s, e, v):
        A, B = self.f[m]
        return self.sigma[m][s] * (B[s, e] @ (A[s, e] @ v.float()))

    def gate_up(self, x, ids, out):
        for t, s in enumerate(self.mapping):
            for j in range(ids.shape[1]):
                e = self.ids[t][j]
                if s >= 0 and e >= 0:
                    d = torch.cat([self._delta(m, s, e, x[t]) for m in ("gate", "up")])
                    out[t, j] = (out[t, j].float() + d).to(out.dtype)

    def down(self, h, ids, w, out):
        k = ids.shape[1]
        for t, s in enumerate(self.mapping):
            for j in range(k):
                e = self.ids[t][j]
                if s >= 0 and e >= 0:
                    out[t, j] = (out[t, j].float() + w[t, j].float() * self._delta("down", s, e, h[t * k + j])
                                 ).to(out.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_layer_equals_the_oracle_and_base_rows_equal_the_base_alone(dtype):
    base, pool, x, ids, weights, mapping = _fp8_case(dtype)
    dev = lambda t: t.to(DEVICE)
    kw = dict(weight_block=base.weight_block, w_gate_up_scale_inv=dev(base.w_gate_up_scale_inv),
              w_down_scale_inv=dev(base.w_down_scale_inv))
    args = (dev(x), dev(ids.contiguous()), dev(weights.contiguous()), dev(base.w_gate_up), dev(base.w_down))
    deltas = _TorchDeltas(pool, mapping, ids, DEVICE)
    with launch_guard():
        y = fused_moe(*args, deltas=deltas, **kw)
        y_base = fused_moe(*args, **kw)
    DEFAULT_POLICY.assert_close(y.cpu(), moe_block_forward(x, ids, weights, base, pool, mapping), dtype=dtype,
                                base_quant="fp8_block", what="w8a8 layer with LoRA vs oracle")
    DEFAULT_POLICY.assert_close(y_base.cpu(), moe_block_forward(x, ids, weights, base, None, None), dtype=dtype,
                                base_quant="fp8_block", what="w8a8 base vs oracle")
    rows = mapping < 0
    assert_bitwise_equal(y.cpu()[rows], y_base.cpu()[rows], what="base rows")


def test_preconditions_are_refused_by_name():
    x = torch.randn(4, 24, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match="block_k"):
        quantize_activation_fp8(x, 0)
    with pytest.raises(KernelPreconditionError, match="QUANT_ROWS: must be a power of two"):
        quantize_activation_fp8(x, 16, config={"QUANT_ROWS": 3})
    base, _, x, ids, _, _ = _fp8_case(torch.float32)
    q, s = quantize_activation_fp8(x.to(DEVICE), 16)
    d_ids = ids.to(DEVICE)
    with launch_guard():
        align = moe_align_block_size(d_ids, 4, 16)
    with pytest.raises(KernelPreconditionError, match="scale_inv"):
        fp8_moe_gemm(q, s, base.w_gate_up.to(DEVICE), base.w_gate_up_scale_inv[:, :3].to(DEVICE),
                     torch.empty(18, 48, device=DEVICE), align, block=(16, 16), top_k=2, num_pairs=18, in_row_div=2,
                     half=24)


def test_the_fp8_gemm_compiles_for_the_h200_at_every_group_width():
    """bk 128 with the shipped H100 tiles (the tensor cores' fp8 dot), bk 24 (padded to 32, fp8 dot) and
    bk 8 / 4 (padded to 16, the widened fp32 dot): compiled for sm_90 here, so a GPU call does not find
    out first (the e2e fixtures' blocks 4 and 8 once reached the GPU refused by a >= 16 precondition)."""
    cases = {f"bk={bk}": qwen3_fp8_gemm_case(bk, k_tile(bk) >= 32) for bk in (128, 24, 8, 4)}
    results = compile_for_h200("moelora_kernels._fp8_block_kernels:_fp8_moe_gemm_kernel", list(cases.values()))
    for name, r in zip(cases, results, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 < r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"


def test_the_activation_quantization_compiles_for_the_h200_at_every_rows_per_program():
    """QUANT_ROWS 1 (one program per row and group) to 64, bk 128, bf16 in, e4m3 out, for sm_90."""
    args = {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32", "rows": 65536, "K": 768, "eps": 1e-10,
            "stride_xm": 768, "stride_qm": 768, "stride_sm": 6}
    cases = [{"args": args, "constexprs": {"GROUP": 128, "BLOCK": 128, "QUANT_ROWS": r, "PDL": False}, "num_warps": 4,
              "num_stages": 1} for r in (1, 16, 64)]
    results = compile_for_h200("moelora_kernels._fp8_block_kernels:_quant_fp8_groups_kernel", cases)
    for r, res in zip((1, 16, 64), results, strict=True):
        assert "error" not in res, f"QUANT_ROWS={r}: {res.get('error')}"
