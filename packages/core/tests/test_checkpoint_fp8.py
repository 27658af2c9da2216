"""fp8 block-scaled base checkpoints (DESIGN.md §1, "Quantized base"): what the reader serves and what
it refuses by name.

Covers: a checkpoint quantized as HF writes the format reads with ``base_quant`` "fp8_block", the
experts' and dense projections' fp8 weights kept as stored (never cast to ``dtype``) with their scale
grids, partial edge blocks included (I = 20 and head widths of 20 at block 16); the layer spec carries
``base_quant``; refusals: another ``quant_method`` (MXFP4 named), per-tensor fp8, static activation
scales, another fp8 format, a missing or mis-shaped scale, an fp8 router, an fp8 tensor without the
config, a module of ``modules_to_not_convert`` stored fp8, an expert left unquantized.
"""

import re

import pytest
import torch

from moelora_core.checkpoint import (
    CheckpointShapeError,
    MissingTensorError,
    MoECheckpoint,
    MoEModelConfig,
    UnsupportedQuantizationError,
)
from moelora_core.checkpoint.synthetic import checkpoint_tensors, model_config_dict, random_model, write_checkpoint
from moelora_core.fp8_block import FP8_DTYPE, quantize_weight_fp8_block

DIMS = dict(hidden=24, inter=20, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)
BLOCK = (16, 16)
QUANTIZED = re.compile(r"\.(experts\.\d+\.(gate|up|down)_proj|self_attn\.[qkvo]_proj)\.weight$")
QC = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic", "fmt": "e4m3",
      "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]}


def _tensors(raw: dict) -> dict[str, torch.Tensor]:
    plain = checkpoint_tensors(random_model(MoEModelConfig.from_dict(raw), seed=3))
    out = {}
    for key, value in plain.items():
        if QUANTIZED.search(key):
            q, s = quantize_weight_fp8_block(value, BLOCK)
            out[key], out[key.removesuffix(".weight") + ".weight_scale_inv"] = q, s
        else:
            out[key] = value
    return out


def _write(tmp_path, qc=QC, edit=None):
    raw = model_config_dict("qwen3_moe", **DIMS)
    tensors = _tensors(raw)
    if qc is not None:
        raw["quantization_config"] = qc
    if edit is not None:
        edit(tensors)
    return write_checkpoint(tmp_path / "ckpt", raw, tensors)


def test_fp8_checkpoint_reads_fp8_weights_with_their_scale_grids(tmp_path):
    with MoECheckpoint(_write(tmp_path), dtype=torch.float16) as ckpt:
        assert (ckpt.config.base_quant, ckpt.config.weight_block) == ("fp8_block", BLOCK)
        assert ckpt.config.layer_spec(max_loras=1, max_rank=4).base_quant == "fp8_block"
        layer = ckpt.layer(1)
    moe = layer.moe
    assert moe.base_quant == "fp8_block" and moe.w_gate_up.dtype == FP8_DTYPE == moe.w_down.dtype
    assert tuple(moe.w_gate_up_scale_inv.shape) == (4, 4, 2)  # gate's ⌈20/16⌉ = 2 row blocks, then up's
    assert tuple(moe.w_down_scale_inv.shape) == (4, 2, 2)
    assert layer.q_proj.dtype == FP8_DTYPE and tuple(layer.dense_scales["q"].shape) == (2, 2)  # 20 x 24
    assert moe.router.dtype == torch.float16 and layer.input_layernorm.dtype == torch.float16  # cast as asked
    assert moe.w_gate_up_scale_inv.dtype == torch.float32  # scales never cast


def test_unquantized_checkpoint_stays_none(tmp_path):
    with MoECheckpoint(_write(tmp_path, qc=None, edit=lambda t: _dequantize_all(t))) as ckpt:
        assert ckpt.config.base_quant == "none" and ckpt.layer(0).moe.base_quant == "none"


def _dequantize_all(t):
    for key in [k for k in t if k.endswith(".weight_scale_inv")]:
        w = key.removesuffix("_scale_inv")
        t[w] = t[w].float()
        del t[key]


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "mxfp4"}, "MXFP4"),
    ({"quant_method": "gptq", "bits": 4}, "only fp8 block-scaled"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor fp8"),
    ({**QC, "activation_scheme": "static"}, "static activation scales"),
    ({**QC, "fmt": "e5m2"}, "e4m3"),
    ({**QC, "weight_block_size": [16]}, "two positive ints"),
])
def test_quantization_configs_moelora_does_not_serve_are_refused(qc, match):
    raw = model_config_dict("qwen3_moe", **DIMS, quantization_config=qc)
    with pytest.raises(UnsupportedQuantizationError, match=match):
        MoEModelConfig.from_dict(raw)


def _drop(key):
    return lambda t: t.pop(key)


def _reshape(key):
    return lambda t: t.__setitem__(key, torch.ones(1, 2))


def _fp8(key):
    return lambda t: t.__setitem__(key, t[key].to(FP8_DTYPE))


E0 = "model.layers.0.mlp.experts.1"


@pytest.mark.parametrize("edit, error, match", [
    (_drop(f"{E0}.down_proj.weight_scale_inv"), MissingTensorError, "block scales of an fp8 weight are missing"),
    (_reshape(f"{E0}.gate_proj.weight_scale_inv"), CheckpointShapeError, r"expected \(2, 2\)"),
    (_reshape("model.layers.1.self_attn.o_proj.weight_scale_inv"), CheckpointShapeError, "scale grid"),
    (_fp8("model.layers.0.mlp.gate.weight"), UnsupportedQuantizationError, "format has no fp8"),  # a router
    (_fp8("model.layers.0.input_layernorm.weight"), UnsupportedQuantizationError, "format has no fp8"),
])
def test_missing_misshaped_or_misplaced_fp8_tensors_are_refused(tmp_path, edit, error, match):
    with pytest.raises(error, match=match):
        MoECheckpoint(_write(tmp_path, edit=edit))


def test_fp8_tensor_without_the_config_is_refused(tmp_path):
    with pytest.raises(UnsupportedQuantizationError, match="without an fp8 quantization_config"):
        MoECheckpoint(_write(tmp_path, qc=None))


def test_a_module_kept_unquantized_by_the_config_but_stored_fp8_is_refused(tmp_path):
    qc = {**QC, "modules_to_not_convert": [*QC["modules_to_not_convert"], "model.layers.1.self_attn.o_proj"]}
    with pytest.raises(UnsupportedQuantizationError, match="listed in modules_to_not_convert"):
        MoECheckpoint(_write(tmp_path, qc=qc))


def test_an_expert_left_unquantized_is_refused(tmp_path):
    def plain_expert(t):
        t[f"{E0}.up_proj.weight"] = t[f"{E0}.up_proj.weight"].float()
        del t[f"{E0}.up_proj.weight_scale_inv"]

    with pytest.raises(UnsupportedQuantizationError, match="every expert weight must be"):
        MoECheckpoint(_write(tmp_path, edit=plain_expert))
