"""Qwen2-MoE in the readers: the shared expert beside the routed experts, and LoRA on it.

Covers: the config (shared_expert_intermediate_size, the shared expert's dense shapes in the layer
spec; qkv_bias, true when absent; dense MLP layers refused); the q/k/v biases read (missing, mis-shaped,
or present without qkv_bias: refused; o never has one); the base reader (shared expert
read to ``DecoderLayerWeights.shared_expert``, per-expert and fused routed experts alike; a missing,
mis-shaped or surplus shared-expert tensor refused; a Qwen3-MoE checkpoint with shared-expert keys
still refused); the adapter reader (``mlp.shared_expert.{gate,up,down}_proj`` keys as the dense
modules shared_gate / shared_up / shared_down, rank_pattern on them; refusals: wrong shapes,
transposed factors, LoRA on the sigmoid gate ``shared_expert_gate``, shared-expert keys for a
model without one, untargeted shared-expert keys); the slot loader (the modules reach the pool;
pools of a model without a shared expert refuse them, changing nothing). Files are written with
safetensors + JSON (``moelora_core.checkpoint.synthetic``); the transformers / peft files are
covered by conformance/tests/test_hf_oracle.py and test_fixtures_bad_adapters.py.
"""

import json

import pytest
import safetensors.torch as st
import torch

from moelora_core import InvalidFieldError, LoRAWeights, SharedExpertWeights
from moelora_core.checkpoint import (
    AdapterFormatError,
    CheckpointFormatError,
    CheckpointShapeError,
    MissingTensorError,
    ModelMismatchError,
    MoECheckpoint,
    MoEModelConfig,
    ShapeMismatchError,
    UnmatchedKeysError,
    UnsupportedModelError,
    UnsupportedTargetError,
    load_adapter_into_slot,
    read_adapter,
)
from moelora_core.checkpoint.synthetic import (
    adapter_tensors,
    checkpoint_tensors,
    model_config_dict,
    random_model,
    write_adapter,
    write_checkpoint,
)

# H != I, 2I, Is and Is != 2I: a shared-expert factor read as another module has the wrong shape.
DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10,
            shared_expert_intermediate_size=40)
PRE = "base_model.model.model.layers"


def _cfg(family="qwen2_moe", **over):
    dims = {**DIMS, **over}
    if family != "qwen2_moe":
        dims.pop("shared_expert_intermediate_size")
    return model_config_dict(family, **dims)


def _shared_factors(r: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    H, si = DIMS["hidden"], DIMS["shared_expert_intermediate_size"]
    return {"shared_gate": (torch.randn(r, H, generator=gen), torch.randn(si, r, generator=gen)),
            "shared_up": (torch.randn(r, H, generator=gen), torch.randn(si, r, generator=gen)),
            "shared_down": (torch.randn(r, si, generator=gen), torch.randn(H, r, generator=gen))}


def _adapter(tmp_path, cfg, layers, **conf):
    tensors, targets = adapter_tensors(cfg, layers)
    config = {**targets, "r": 2, "lora_alpha": 4, "target_parameters": targets["target_parameters"] or None, **conf}
    return write_adapter(tmp_path / "adapter", tensors, config), tensors, config


def _set_targets(path, targets):
    file = path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "target_modules": targets}))


# --- config ----------------------------------------------------------------------------------------


def test_the_config_gives_the_shared_expert_dense_shapes():
    cfg = MoEModelConfig.from_dict(_cfg())
    assert cfg.family.shared_expert and cfg.shared_expert_intermediate_size == 40
    assert cfg.norm_topk_prob is True  # as written by model_config_dict; the family default is False
    shapes = cfg.dense_shapes
    assert (shapes["shared_gate"], shapes["shared_up"], shapes["shared_down"]) == ((24, 40), (24, 40), (40, 24))
    spec = cfg.layer_spec(max_loras=2, max_rank=4)
    assert set(spec.dense_shapes) == {"q", "k", "v", "o", "shared_gate", "shared_up", "shared_down"}
    pool = LoRAWeights(spec)
    assert pool.dense_A["shared_down"].shape == (2, 4, 40) and pool.dense_B["shared_down"].shape == (2, 24, 4)
    # A family without a shared expert keeps the attention modules only.
    assert set(MoEModelConfig.from_dict(_cfg("qwen3_moe")).dense_shapes) == {"q", "k", "v", "o"}


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"mlp_only_layers": [0]}, r"dense MLP layers are not supported"),
        ({"decoder_sparse_step": 2}, r"dense MLP layers are not supported"),
    ],
)
def test_unsupported_qwen2_moe_configs(over, match):
    with pytest.raises(UnsupportedModelError, match=match):
        MoEModelConfig.from_dict({**_cfg(), **over})


def test_an_absent_qkv_bias_means_biases():
    # Qwen2MoeConfig's default is qkv_bias=True (Qwen1.5-MoE ships q/k/v biases); o has none.
    raw = _cfg()
    raw.pop("qkv_bias")
    assert MoEModelConfig.from_dict(raw).qkv_bias is True
    assert MoEModelConfig.from_dict(_cfg()).qkv_bias is False  # as model_config_dict writes it
    assert MoEModelConfig.from_dict({**_cfg("qwen3_moe"), "qkv_bias": True}).qkv_bias is False  # not a Qwen3 field


def test_qkv_biases_are_read(tmp_path):
    raw = _cfg(qkv_bias=True)
    want = random_model(MoEModelConfig.from_dict(raw), seed=8)
    tensors = checkpoint_tensors(want)
    assert tensors["model.layers.1.self_attn.k_proj.bias"].shape == (10,) and "self_attn.o_proj.bias" not in str(
        sorted(tensors))
    write_checkpoint(tmp_path, raw, tensors)
    with MoECheckpoint(tmp_path) as ckpt:
        got = ckpt.layer(1)
    for m in "qkv":
        assert torch.equal(got.bias(m), want.layers[1].bias(m))
    assert got.bias("o") is None and got.bias("shared_gate") is None


@pytest.mark.parametrize(
    ("qkv_bias", "edit", "error", "match"),
    [
        (True, lambda t: t.pop("model.layers.0.self_attn.v_proj.bias"), MissingTensorError,
         r"v_proj\.bias: required tensor is missing"),
        (True, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(24)}), CheckpointShapeError,
         r"q_proj\.bias: wrong shape \(expected \(20,\), found \(24,\)\)"),
        (False, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(20)}), UnsupportedModelError,
         r"q_proj\.bias.*layout has no place for"),
        (True, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(24)}), UnsupportedModelError,
         r"o_proj\.bias.*layout has no place for"),
    ],
    ids=["missing", "wrong-shape", "without-qkv_bias", "o-bias"],
)
def test_qkv_bias_refusals(tmp_path, qkv_bias, edit, error, match):
    raw = _cfg(qkv_bias=qkv_bias)
    tensors = checkpoint_tensors(random_model(MoEModelConfig.from_dict(raw), seed=9))
    edit(tensors)
    write_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(error, match=match):
        MoECheckpoint(tmp_path)


@pytest.mark.parametrize("value", [None, 0, "40"])
def test_a_missing_or_bad_shared_width_is_named(value):
    raw = _cfg()
    raw["shared_expert_intermediate_size"] = value
    with pytest.raises(CheckpointFormatError, match=r"shared_expert_intermediate_size: must be an int >= 1"):
        MoEModelConfig.from_dict(raw)


# --- base reader -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_the_shared_expert_is_read_beside_either_expert_form(tmp_path, fused):
    raw = _cfg()
    want = random_model(MoEModelConfig.from_dict(raw), seed=5)
    write_checkpoint(tmp_path, raw, checkpoint_tensors(want, fused=fused))
    with MoECheckpoint(tmp_path) as ckpt:
        for li in range(ckpt.config.num_layers):
            got, exp = ckpt.layer(li), want.layers[li]
            for name in ("gate_proj", "up_proj", "down_proj", "gate"):
                assert torch.equal(getattr(got.shared_expert, name), getattr(exp.shared_expert, name))
            assert torch.equal(got.dense("shared_down"), exp.shared_expert.down_proj)
            assert torch.equal(got.moe.w_gate_up, exp.moe.w_gate_up)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda t: t.pop("model.layers.1.mlp.shared_expert_gate.weight"), MissingTensorError,
         r"layers\.1\.mlp\.shared_expert_gate\.weight: required tensor is missing"),
        (lambda t: t.update({"model.layers.0.mlp.shared_expert.down_proj.weight": torch.zeros(40, 24)}),
         CheckpointShapeError, r"shared_expert\.down_proj\.weight: wrong shape \(expected \(24, 40\), found \(40, 24\)\)"),
        (lambda t: t.update({"model.layers.0.mlp.shared_expert.gate_proj.bias": torch.zeros(40)}),
         UnsupportedModelError, r"shared_expert\.gate_proj\.bias.*layout has no place for"),
    ],
    ids=["missing-gate", "transposed-down", "bias"],
)
def test_shared_expert_tensor_refusals(tmp_path, edit, error, match):
    raw = _cfg()
    tensors = checkpoint_tensors(random_model(MoEModelConfig.from_dict(raw), seed=6))
    edit(tensors)
    write_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(error, match=match):
        MoECheckpoint(tmp_path)


def test_a_qwen3_moe_checkpoint_with_a_shared_expert_is_still_refused(tmp_path):
    raw = _cfg("qwen3_moe")
    tensors = checkpoint_tensors(random_model(MoEModelConfig.from_dict(raw), seed=7))
    tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(40, 24)
    write_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(UnsupportedModelError, match=r"the Qwen3-MoE layout has no place for"):
        MoECheckpoint(tmp_path)


def test_shared_expert_weights_check_their_shapes():
    si, h = 6, 4
    with pytest.raises(InvalidFieldError, match=r"down_proj: expected \(4, 6\)"):
        SharedExpertWeights(torch.zeros(si, h), torch.zeros(si, h), torch.zeros(si, h), torch.zeros(1, h))
    with pytest.raises(InvalidFieldError, match=r"gate: expected \(1, 4\)"):
        SharedExpertWeights(torch.zeros(si, h), torch.zeros(si, h), torch.zeros(h, si), torch.zeros(h))


# --- adapters --------------------------------------------------------------------------------------


def test_shared_expert_lora_is_read_as_dense_modules(tmp_path):
    cfg = MoEModelConfig.from_dict(_cfg())
    factors = _shared_factors(2)
    path, _, config = _adapter(tmp_path, cfg, {0: factors, 1: _shared_factors(2, seed=1)},
                               rank_pattern={"shared_expert.down_proj": 3}, use_rslora=True)
    assert config["target_modules"] == ["shared_expert.down_proj", "shared_expert.gate_proj", "shared_expert.up_proj"]
    # down at rank 3 by the pattern: rewrite its factors at that rank.
    tensors = st.load_file(str(path / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    for li in (0, 1):
        key = f"{PRE}.{li}.mlp.shared_expert.down_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(3, 40, generator=gen)
        tensors[f"{key}.lora_B.weight"] = torch.randn(24, 3, generator=gen)
    st.save_file(tensors, str(path / "adapter_model.safetensors"))
    read = read_adapter(path, cfg)
    assert read.modules() == ("shared_gate", "shared_up", "shared_down")
    layer0 = read.layers[0]
    assert torch.equal(layer0["shared_gate"].lora_A, factors["shared_gate"][0])
    assert torch.equal(layer0["shared_up"].lora_B, factors["shared_up"][1])
    assert layer0["shared_down"].rank == 3 and layer0["shared_down"].lora_A.shape == (3, 40)
    assert layer0["shared_gate"].scaling == pytest.approx(4 / 2 ** 0.5)
    assert layer0["shared_down"].scaling == pytest.approx(4 / 3 ** 0.5)
    # Into the pools: the shared modules' ranks and σ, nothing in the routed experts.
    pools = [LoRAWeights(cfg.layer_spec(max_loras=2, max_rank=4)) for _ in range(2)]
    load_adapter_into_slot(pools, 1, read)
    assert pools[0].host_ranks["shared_down"][1] == 3 and pools[0].host_ranks["gate"][1] == 0
    assert torch.equal(pools[1].dense_A["shared_up"][1, :2], read.layers[1]["shared_up"].lora_A)


@pytest.mark.parametrize(
    ("module", "factor", "shape", "match"),
    [
        ("down_proj", "lora_B", (23, 2), r"shared_expert\.down_proj\.lora_B\.weight.*expected \(24, 2\), found \(23, 2\)"),
        ("up_proj", "lora_A", (24, 2), r"shared_expert\.up_proj\.lora_A\.weight.*expected \(2, 24\), found \(24, 2\)"),
        ("gate_proj", "lora_B", (16, 2), r"shared_expert\.gate_proj\.lora_B\.weight.*expected \(40, 2\), found \(16, 2\)"),
    ],
    ids=["down-lost-a-row", "up-A-transposed", "gate-B-at-the-expert-width"],
)
def test_shared_expert_lora_with_wrong_shapes_is_refused(tmp_path, module, factor, shape, match):
    cfg = MoEModelConfig.from_dict(_cfg())
    path, tensors, _ = _adapter(tmp_path, cfg, {0: _shared_factors(2), 1: _shared_factors(2, seed=1)})
    tensors = dict(tensors)
    tensors[f"{PRE}.0.mlp.shared_expert.{module}.{factor}.weight"] = torch.ones(shape)
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    with pytest.raises(ShapeMismatchError, match=match):
        read_adapter(path, cfg)


def test_lora_on_the_sigmoid_gate_is_refused(tmp_path):
    cfg = MoEModelConfig.from_dict(_cfg())
    path, tensors, _ = _adapter(tmp_path, cfg, {0: _shared_factors(2)})
    tensors = {**tensors, f"{PRE}.0.mlp.shared_expert_gate.lora_A.weight": torch.ones(2, 24),
               f"{PRE}.0.mlp.shared_expert_gate.lora_B.weight": torch.ones(1, 2)}
    st.save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(UnsupportedTargetError, match=r"shared_expert_gate\.lora_A.*shared expert's sigmoid gate"):
        read_adapter(path, cfg)
    # Named by the config too, before any key is read.
    _set_targets(path, ["shared_expert_gate"])
    with pytest.raises(UnsupportedTargetError, match=r"target_modules: LoRA on the shared expert's sigmoid gate.*"
                                                      r"targets moelora does not serve.*shared_expert_gate"):
        read_adapter(path, cfg)


def test_shared_expert_keys_for_a_model_without_one_are_refused(tmp_path):
    qwen2 = MoEModelConfig.from_dict(_cfg())
    path, _, _ = _adapter(tmp_path, qwen2, {0: _shared_factors(2)})
    qwen3 = MoEModelConfig.from_dict({**_cfg("qwen3_moe"), "architectures": ["Qwen2MoeForCausalLM"]})
    with pytest.raises(UnmatchedKeysError, match=r"6 key\(s\): keys that match no module"):
        read_adapter(path, qwen3)


def test_untargeted_shared_expert_keys_are_refused(tmp_path):
    cfg = MoEModelConfig.from_dict(_cfg())
    path, _, _ = _adapter(tmp_path, cfg, {0: _shared_factors(2)})
    _set_targets(path, ["shared_expert.gate_proj", "shared_expert.up_proj"])
    with pytest.raises(AdapterFormatError, match=r"shared_expert\.down_proj.*modules the config does not target"):
        read_adapter(path, cfg)


def test_pools_without_a_shared_expert_refuse_its_modules_and_change_nothing(tmp_path):
    cfg = MoEModelConfig.from_dict(_cfg())
    path, _, _ = _adapter(tmp_path, cfg, {0: _shared_factors(2), 1: _shared_factors(2, seed=1)})
    read = read_adapter(path, cfg)
    qwen3 = MoEModelConfig.from_dict(_cfg("qwen3_moe"))
    pools = [LoRAWeights(qwen3.layer_spec(max_loras=2, max_rank=4)) for _ in range(2)]
    before = [p.dense_A["q"].clone() for p in pools]
    with pytest.raises(ModelMismatchError, match=r"layer 0 shared_\w+: the pool.s layer spec has no such module"):
        load_adapter_into_slot(pools, 0, read)
    assert all(torch.equal(p.dense_A["q"], b) and p.slot_rank(0) == 0 for p, b in zip(pools, before))
