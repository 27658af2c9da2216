"""fp8 block-scaled base weights (DESIGN.md §1, "Quantized base"): shapes, checks and the refusals.

Covers: the scale grid counts partial edge blocks (DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` at
block 128); the weight quantizer's values lie within half an e4m3 step of W; ``MoEBaseWeights``
refuses fp8 weights without a block, a missing or mis-shaped scale; ``LoRALayerSpec.base_quant`` and
``Capabilities.base_quants`` refuse unknown values; a backend that does not declare the model's
``base_quant`` is refused by name (``UnsupportedBaseQuantError``); the built-in backends declare what
they serve.
"""

import pytest
import torch

from moelora_core import Capabilities, InvalidFieldError, LoRALayerSpec, MoEBaseWeights
from moelora_core.backend import check_base_quant_served, load_backend
from moelora_core.errors import UnsupportedBaseQuantError
from moelora_core.fp8_block import FP8_DTYPE, check_scale, quantize_weight_fp8_block, scale_grid


def test_scale_grid_counts_partial_edge_blocks():
    assert scale_grid(576, 7168, (128, 128)) == (5, 56)  # DeepSeek-V3 kv_a_proj_with_mqa: 576 = 4.5 blocks
    assert scale_grid(40, 16, (16, 16)) == (3, 1)


@pytest.mark.parametrize("shape", [(40, 24), (3, 33, 17)])  # partial blocks in both dims; a leading expert dim
def test_quantized_weight_dequantizes_within_half_an_e4m3_step(shape):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=gen) * 3
    q, s = quantize_weight_fp8_block(w, (16, 16))
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert tuple(s.shape) == (*shape[:-2], *scale_grid(*shape[-2:], (16, 16)))
    full = s.repeat_interleave(16, -2).repeat_interleave(16, -1)[..., :shape[-2], :shape[-1]]
    err = (q.float() * full - w).abs()
    assert bool((err <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * full).all())  # relative half-step or subnormal step
    check_scale(q, s, (16, 16), "w")


def _fp8_base(E=2, inter=24, hidden=20, block=(16, 16)):
    gen = torch.Generator().manual_seed(2)
    qg, sg = quantize_weight_fp8_block(torch.randn(E, inter, hidden, generator=gen), block)
    qu, su = quantize_weight_fp8_block(torch.randn(E, inter, hidden, generator=gen), block)
    qd, sd = quantize_weight_fp8_block(torch.randn(E, hidden, inter, generator=gen), block)
    return dict(w_gate_up=torch.cat([qg, qu], 1), w_down=qd, weight_block=block,
                w_gate_up_scale_inv=torch.cat([sg, su], 1), w_down_scale_inv=sd)


def test_fp8_base_weights_validate_and_report_base_quant():
    base = MoEBaseWeights(**_fp8_base())
    assert base.base_quant == "fp8_block"
    assert tuple(base.w_gate_up_scale_inv.shape) == (2, 4, 2)  # gate's 2 row blocks of I = 24, then up's
    assert MoEBaseWeights(torch.randn(2, 8, 4), torch.randn(2, 4, 4)).base_quant == "none"


@pytest.mark.parametrize("change, field", [
    ({"weight_block": None}, "weight_block"),  # fp8 weights without a block size
    ({"w_down_scale_inv": None}, "w_down_scale_inv"),  # a missing scale
    ({"w_gate_up_scale_inv": torch.ones(2, 3, 2)}, "w_gate_up_scale_inv"),  # the fused [2I] grid, not per half
    ({"weight_block": (16, 0)}, "weight_block"),
])
def test_fp8_base_weights_refuse_missing_or_misshaped_scales(change, field):
    kwargs = {**_fp8_base(), **change}
    if field == "weight_block" and change.get("weight_block") is None:
        kwargs.pop("w_gate_up_scale_inv"), kwargs.pop("w_down_scale_inv")
    with pytest.raises(InvalidFieldError, match=field):
        MoEBaseWeights(**kwargs)


def test_spec_and_capabilities_refuse_unknown_base_quant():
    with pytest.raises(InvalidFieldError, match="base_quant"):
        LoRALayerSpec(8, 8, 2, 1, {}, 1, 1, base_quant="mxfp4")
    with pytest.raises(InvalidFieldError, match="base_quants"):
        Capabilities(dtypes={torch.float32}, base_quants={"int4"})
    assert Capabilities(dtypes={torch.float32}).base_quants == frozenset({"none"})


def test_backend_not_declaring_the_base_quant_is_refused_by_name():
    spec = LoRALayerSpec(8, 8, 2, 1, {}, 1, 1, base_quant="fp8_block")
    caps = load_backend("csgmv")(spec).capabilities()
    with pytest.raises(UnsupportedBaseQuantError,
                       match=r"^backend 'csgmv' does not declare base_quant=fp8_block$"):
        check_base_quant_served("csgmv", caps, spec.base_quant)
    check_base_quant_served("reference", load_backend("reference")(spec).capabilities(), "fp8_block")
    check_base_quant_served("csgmv", caps, "none")


def test_fp8_block_rows_are_looked_up_by_base_quant():
    from moelora_core import DEFAULT_POLICY
    from moelora_core.tolerance import FP8_BLOCK_TOLERANCES

    assert DEFAULT_POLICY.lookup(torch.float32, base_quant="fp8_block") is FP8_BLOCK_TOLERANCES["float32"]
    assert DEFAULT_POLICY.lookup(torch.bfloat16, "cuda", base_quant="fp8_block").name == "fp8-block-bf16"
    assert DEFAULT_POLICY.lookup(torch.float32).max_rel == 1e-5  # the plain rows are unchanged
    with pytest.raises(KeyError, match="base_quant=mxfp4"):
        DEFAULT_POLICY.lookup(torch.float32, base_quant="mxfp4")
