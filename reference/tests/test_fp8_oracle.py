"""The oracle's fp8 block-scaled w8a8 base (DESIGN.md §1, "Quantized base") and the torch base path's.

Covers: the oracle's e4m3 rounding equals torch's cast on every e4m3 value and every midpoint (ties
to even) and the torch path's explicit rounding; the clamp saturates (464 → 448, where the
interpreter's cast gives NaN); a hand-computed group quantization with a partial last group; the
w8a8 product uses partial edge blocks of the weight grid; the torch base path equals the oracle within
the fp8 rows; base rows without an adapter are bit-identical to the base alone; LoRA reads the
unquantized activations (dense: y − y_base equals σ·B(A x) of the unquantized x).
"""

import math

import pytest
import torch

from moelora_core import DEFAULT_POLICY, LoRALayerSpec, LoRAWeights, ModuleLoRA, MoEBaseWeights
from moelora_core.fp8_block import quantize_weight_fp8_block
from moelora_reference import base_moe
from moelora_reference.fp8_block import dequantize_activation, round_to_e4m3
from moelora_reference.oracle import (
    dense_lora_forward,
    e4m3_round,
    fp8_block_matvec,
    fp8_group_quantize,
    moe_block_forward,
)

F64 = torch.float64


def _e4m3_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)
    return codes[torch.isfinite(codes)].unique().sort().values


def test_e4m3_rounding_matches_torch_cast_on_values_and_midpoints():
    vals = _e4m3_values()
    mids = (vals[1:] + vals[:-1]) / 2  # every tie: to the even mantissa
    inputs = torch.cat([vals, mids, torch.randn(500, dtype=F64, generator=torch.Generator().manual_seed(0)) * 40])
    inputs = inputs.clamp(-448, 448).to(torch.float32).to(F64)
    expected = inputs.to(torch.float32).to(torch.float8_e4m3fn).to(F64)  # torch's CPU cast: RNE, subnormals
    assert torch.equal(e4m3_round(inputs), expected)
    assert torch.equal(round_to_e4m3(inputs.to(torch.float32)).to(F64), expected)


def test_group_quantization_by_hand_with_a_partial_last_group():
    # block 4 over K = 6: groups [0:4] and [4:6]; amax 448 → s = 1 (exact values survive, 17 → 16 (tie to even),
    # 464 is impossible after the scale), amax 0 → the eps floor, zeros stay zeros.
    v = torch.tensor([448.0, -17.0, 0.3, 1.0, 0.0, 0.0], dtype=F64)
    out = fp8_group_quantize(v, 4)
    assert out.tolist() == [448.0, -16.0, 0.3125, 1.0, 0.0, 0.0]
    # The scale is amax / 448 in fp32: 464 / (464 / 448) = 448, never above (the clamp covers the rounding).
    v2 = torch.tensor([464.0, 1.0], dtype=F64)
    s = float(torch.tensor(464.0 / 448.0, dtype=torch.float32))
    assert fp8_group_quantize(v2, 2)[0].item() == pytest.approx(448.0 * s, rel=0, abs=0)
    torch_path = dequantize_activation(v2[None].to(torch.float32), 2)[0].to(F64)
    assert torch.equal(torch_path, fp8_group_quantize(v2, 2).to(torch.float32).to(F64))


def test_blockwise_product_uses_partial_edge_blocks():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 20, generator=gen)  # 40 rows at block 16: 2.5 row blocks; 20 columns: 1.25
    q, s = quantize_weight_fp8_block(w, (16, 16))
    v = torch.randn(20, generator=gen, dtype=F64)
    y = fp8_block_matvec(q, s, (16, 16), v)
    what = q.to(F64) * s.to(F64).repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :20]
    assert torch.allclose(y, what @ fp8_group_quantize(v, 16), rtol=0, atol=1e-12)
    assert (y - w.to(F64) @ v).abs().max() > 0  # quantized, not the unquantized product


def _case(dtype, T=7, H=20, inter=24, E=3, k=2, r=4, block=(16, 16), seed=5):
    gen = torch.Generator().manual_seed(seed)
    qg, sg = quantize_weight_fp8_block(torch.randn(E, inter, H, generator=gen) / math.sqrt(H), block)
    qu, su = quantize_weight_fp8_block(torch.randn(E, inter, H, generator=gen) / math.sqrt(H), block)
    qd, sd = quantize_weight_fp8_block(torch.randn(E, H, inter, generator=gen) / math.sqrt(inter), block)
    base = MoEBaseWeights(torch.cat([qg, qu], 1), qd, weight_block=block,
                          w_gate_up_scale_inv=torch.cat([sg, su], 1), w_down_scale_inv=sd)
    pool = LoRAWeights(LoRALayerSpec(H, inter, E, k, {"q": (H, 12)}, 2, r, dtype=dtype, base_quant="fp8_block"))
    mods = {m: ModuleLoRA(torch.randn(E, r, i, generator=gen) / math.sqrt(i), torch.randn(E, o, r, generator=gen), 0.5)
            for m, (i, o) in (("gate", (H, inter)), ("up", (H, inter)), ("down", (inter, H)))}
    mods["q"] = ModuleLoRA(torch.randn(r, H, generator=gen), torch.randn(12, r, generator=gen), 0.5)
    pool.load_slot(1, mods)
    x = torch.randn(T, H, generator=gen).to(dtype)
    weights, ids = base_moe.route_topk(torch.randn(T, E, generator=gen), k, True)
    mapping = torch.tensor([1, -1, 1, 1, -1, 1, 1][:T], dtype=torch.int32)
    return base, pool, x, ids, weights, mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_base_path_equals_oracle_without_adapters(dtype, guard):
    base, _, x, ids, weights, _ = _case(dtype)
    with guard():
        y = base_moe.moe_forward(x, ids, weights, base)
    DEFAULT_POLICY.assert_close(y, moe_block_forward(x, ids, weights, base, None, None), dtype=dtype,
                                base_quant="fp8_block", what="fp8 base path vs oracle")


def test_oracle_base_rows_equal_the_quantized_base_alone():
    base, pool, x, ids, weights, mapping = _case(torch.float32)
    with_lora = moe_block_forward(x, ids, weights, base, pool, mapping)
    alone = moe_block_forward(x, ids, weights, base, None, None)
    rows = mapping < 0
    assert torch.equal(with_lora[rows], alone[rows])
    assert (with_lora[~rows] - alone[~rows]).abs().min() > 0


def test_dense_delta_reads_the_unquantized_activations():
    _, pool, x, _, _, mapping = _case(torch.float32)
    gen = torch.Generator().manual_seed(9)
    q, s = quantize_weight_fp8_block(torch.randn(12, 20, generator=gen), (16, 16))
    y = dense_lora_forward(x, q, "q", pool, mapping, weight_block=(16, 16), weight_scale_inv=s)
    y_base = dense_lora_forward(x, q, "q", None, None, weight_block=(16, 16), weight_scale_inv=s)
    A, B = pool.factors("q")
    delta = 0.5 * (x.to(F64) @ A[1].to(F64).T @ B[1].to(F64).T)  # σ · B (A x), x as given
    rows = mapping == 1
    assert torch.allclose(y[rows] - y_base[rows], delta[rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(y[~rows], y_base[~rows])


def _what(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Ŵ = W_q · scale_inv of its blocks, fp64 (partial edge blocks cut)."""
    n, k = q.shape
    return q.to(F64) * s.to(F64).repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def test_shared_expert_quantizes_each_fp8_projection_and_not_its_gate():
    # Qwen2-MoE's shared expert stored fp8: gate_proj and up_proj read x̂, down_proj reads the activated
    # silu(g) ⊙ u quantized (ĥ), the sigmoid gate reads x unquantized (modules_to_not_convert), and the
    # shared_down delta reads h unquantized (DESIGN.md §1); written out here by hand, token by token
    from moelora_core.errors import InvalidFieldError
    from moelora_core.shared_expert import SharedExpertWeights
    from moelora_reference.oracle import shared_expert_forward

    T, H, Is, r, block = 5, 24, 20, 3, (8, 8)  # Is 20 at block 8: a partial edge block
    gen = torch.Generator().manual_seed(11)
    (qg, sg), (qu, su), (qd, sd) = (quantize_weight_fp8_block(torch.randn(o, i, generator=gen) / math.sqrt(i), block)
                                    for o, i in ((Is, H), (Is, H), (H, Is)))
    shared = SharedExpertWeights(qg, qu, qd, torch.randn(1, H, generator=gen))
    scales = {"shared_gate": sg, "shared_up": su, "shared_down": sd}
    pool = LoRAWeights(LoRALayerSpec(H, 8, 2, 1, {"shared_gate": (H, Is), "shared_up": (H, Is),
                                                  "shared_down": (Is, H)}, 2, r, base_quant="fp8_block"))
    A, B = torch.randn(r, Is, generator=gen), torch.randn(H, r, generator=gen)
    pool.load_slot(1, {"shared_down": ModuleLoRA(A, B, 0.5)})
    x = torch.randn(T, H, generator=gen)
    mapping = torch.tensor([1, -1, 1, -1, 1], dtype=torch.int32)
    y = shared_expert_forward(x, shared, pool, mapping, weight_block=block, weight_scales=scales)
    for t in range(T):
        xt = x[t].to(F64)
        x_hat = fp8_group_quantize(xt, block[1])
        g, u = _what(qg, sg, block) @ x_hat, _what(qu, su, block) @ x_hat
        h = g * torch.sigmoid(g) * u
        d = _what(qd, sd, block) @ fp8_group_quantize(h, block[1])
        if mapping[t] == 1:
            d = d + 0.5 * (B.to(F64) @ (A.to(F64) @ h))
        want = torch.sigmoid(shared.gate.to(F64) @ xt) * d
        assert torch.allclose(y[t], want, rtol=1e-12, atol=1e-12), t
    with pytest.raises(InvalidFieldError, match="not modules of this shared expert"):
        shared_expert_forward(x, shared, None, None, weight_block=block, weight_scales={"q": sg})
    with pytest.raises(InvalidFieldError, match="weight_block"):
        shared_expert_forward(x, shared, None, None, weight_scales=scales)
