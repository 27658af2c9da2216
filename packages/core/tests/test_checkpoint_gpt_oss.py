"""GPT-OSS in the readers (DESIGN.md §1; ``moelora_core.checkpoint.gpt_oss``): the config's family,
biases and per-layer attention, the interleaved layout converted exactly, PEFT's factor layout, and
refusals that name what is wrong (a missing sink, bad layer_types, shapes that do not fit).

The whole-model parity against transformers + PEFT is ``conformance/tests/test_gpt_oss_layer.py``
and hf-check's GPT-OSS cases."""

import pytest
import torch
from safetensors.torch import save_file

from moelora_core.checkpoint import CheckpointFormatError, MissingTensorError, MoECheckpoint, MoEModelConfig
from moelora_core.checkpoint.gpt_oss import deinterleave, gpt_oss_experts, gpt_oss_lora_factors, split_gate_up_lora
from moelora_core.errors import InvalidFieldError
from moelora_core.moe_activation import SWIGLU_OAI

H, I, E, NH, NKV, D, V = 12, 5, 3, 2, 1, 4, 16  # noqa: E741

RAW = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": H,
    "intermediate_size": I,
    "num_local_experts": E,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": NH,
    "num_key_value_heads": NKV,
    "head_dim": D,
    "vocab_size": V,
    "sliding_window": 3,
    "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"],
    "hidden_act": "silu",
}


def test_config_reads_the_family_biases_and_windows():
    c = MoEModelConfig.from_dict(RAW)
    assert c.family.model_type == "gpt_oss" and c.family.activation == SWIGLU_OAI
    assert c.family.gate_up_layout == "interleaved" and c.norm_topk_prob  # softmax over the top-k logits
    assert c.qkv_bias and c.o_bias and c.sliding_window == 3
    assert c.layer_types == ("sliding_attention", "full_attention")
    default = MoEModelConfig.from_dict({k: v for k, v in RAW.items() if k != "layer_types"})
    assert default.layer_types == ("sliding_attention", "full_attention")  # GptOssConfig's default


@pytest.mark.parametrize(
    "field, value", [("layer_types", ["sliding_attention"]), ("layer_types", ["full", "full"]), ("sliding_window", 0)]
)
def test_bad_attention_fields_are_refused_by_name(field, value):
    with pytest.raises(CheckpointFormatError, match=field):
        MoEModelConfig.from_dict({**RAW, field: value})


def test_deinterleave_and_experts_are_exact():
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(E, H, 2 * I, generator=gen)
    b = torch.randn(E, 2 * I, generator=gen)
    d, bd = torch.randn(E, I, H, generator=gen), torch.randn(E, H, generator=gen)
    w_gu, b_gu, w_d, b_d = gpt_oss_experts(gu, b, d, bd)
    assert torch.equal(w_gu[:, :I], gu[:, :, 0::2].transpose(1, 2)) and torch.equal(
        w_gu[:, I:], gu[:, :, 1::2].transpose(1, 2)
    )
    assert torch.equal(b_gu, deinterleave(b)) and torch.equal(b_gu[:, :I], b[:, 0::2])
    assert torch.equal(w_d, d.transpose(1, 2)) and torch.equal(b_d, bd)
    with pytest.raises(InvalidFieldError, match="down_proj"):
        gpt_oss_experts(gu, b, d.transpose(1, 2), bd)


def test_peft_factors_expert_major_a_rank_major_b():
    r = 2
    a = torch.arange(E * r * H, dtype=torch.float32).reshape(E * r, H)
    b = torch.arange(2 * I * r * E, dtype=torch.float32).reshape(2 * I, r * E)
    A, B = gpt_oss_lora_factors(a, b, E)
    assert torch.equal(A[1], a[r : 2 * r]) and torch.equal(B[1][:, 0], b[:, 1]) and torch.equal(B[1][:, 1], b[:, E + 1])
    parts = split_gate_up_lora(A, B)
    assert torch.equal(parts["gate"][1], B[:, 0::2]) and torch.equal(parts["up"][1], B[:, 1::2])
    with pytest.raises(InvalidFieldError, match="rank"):
        gpt_oss_lora_factors(a, torch.ones(2 * I, (r + 1) * E), E)  # B of rank 3 beside A of rank 2


def _checkpoint(tmp_path, drop: str | None = None):
    import json

    gen = torch.Generator().manual_seed(1)
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for layer in range(2):
        p = f"model.layers.{layer}"
        for m, out in (("q", NH * D), ("k", NKV * D), ("v", NKV * D)):
            t[f"{p}.self_attn.{m}_proj.weight"], t[f"{p}.self_attn.{m}_proj.bias"] = (out, H), (out,)
        t[f"{p}.self_attn.o_proj.weight"], t[f"{p}.self_attn.o_proj.bias"] = (H, NH * D), (H,)
        t[f"{p}.self_attn.sinks"] = (NH,)
        t[f"{p}.input_layernorm.weight"] = t[f"{p}.post_attention_layernorm.weight"] = (H,)
        t[f"{p}.mlp.router.weight"], t[f"{p}.mlp.router.bias"] = (E, H), (E,)
        t[f"{p}.mlp.experts.gate_up_proj"], t[f"{p}.mlp.experts.gate_up_proj_bias"] = (E, H, 2 * I), (E, 2 * I)
        t[f"{p}.mlp.experts.down_proj"], t[f"{p}.mlp.experts.down_proj_bias"] = (E, I, H), (E, H)
    tensors = {k: torch.randn(s, generator=gen) for k, s in t.items() if k != drop}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(RAW))
    return tensors


def test_the_base_reader_converts_and_keeps_every_tensor(tmp_path):
    tensors = _checkpoint(tmp_path)
    with MoECheckpoint(tmp_path) as ckpt:
        layer = ckpt.layer(1)
    p = "model.layers.1"
    assert torch.equal(layer.sinks, tensors[f"{p}.self_attn.sinks"])
    assert torch.equal(layer.o_bias, tensors[f"{p}.self_attn.o_proj.bias"])
    assert torch.equal(layer.moe.router_bias, tensors[f"{p}.mlp.router.bias"])
    assert torch.equal(layer.moe.b_gate_up[:, I:], tensors[f"{p}.mlp.experts.gate_up_proj_bias"][:, 1::2])
    assert layer.moe.activation == SWIGLU_OAI


def test_a_missing_sink_is_refused_by_name(tmp_path):
    _checkpoint(tmp_path, drop="model.layers.1.self_attn.sinks")
    with pytest.raises(MissingTensorError, match=r"layers\.1\.self_attn\.sinks"):
        MoECheckpoint(tmp_path)
