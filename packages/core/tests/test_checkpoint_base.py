"""Base checkpoint reader (moelora_core.checkpoint.MoECheckpoint) on synthetic files.

Covers: per-expert keys of each family and the fused 3-D form read to the same layout (gate rows
first; Mixtral w1 = gate, w3 = up, w2 = down); sharded (index, no index); tied embeddings; config
field variants; dtype cast; and the refusals: transposed stacks, missing / extra tensors, keys
stored twice, unsupported families and features. Real transformers checkpoints are covered by
conformance/tests/test_hf_*.py.
"""

import json
import subprocess
import sys

import pytest
import torch

from moelora_core.checkpoint import (
    CheckpointFormatError,
    CheckpointShapeError,
    MissingTensorError,
    MoECheckpoint,
    MoEModelConfig,
    UnsupportedModelError,
    read_checkpoint,
    read_model_config,
)
from moelora_core.checkpoint.synthetic import checkpoint_tensors, model_config_dict, random_model, write_checkpoint

# H != 2I and heads·head_dim != H, so a transposed read has the wrong shape.
DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)


def _model(family, **over):
    raw = model_config_dict(family, **{**DIMS, **over})
    return raw, MoEModelConfig.from_dict(raw)


def _assert_same(read, want):
    assert torch.equal(read.embed_tokens, want.embed_tokens)
    assert torch.equal(read.norm, want.norm)
    assert torch.equal(read.lm_head, want.lm_head)
    for got, exp in zip(read.layers, want.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(got, name), getattr(exp, name)), name
        for name in ("q_norm", "k_norm"):
            a, b = getattr(got, name), getattr(exp, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        assert torch.equal(got.moe.w_gate_up, exp.moe.w_gate_up)
        assert torch.equal(got.moe.w_down, exp.moe.w_down)
        assert torch.equal(got.moe.router, exp.moe.router)
        assert got.moe.norm_topk_prob == exp.moe.norm_topk_prob
        assert (got.shared_expert is None) == (exp.shared_expert is None)
        if exp.shared_expert is not None:
            for name in ("gate_proj", "up_proj", "down_proj", "gate"):
                assert torch.equal(getattr(got.shared_expert, name), getattr(exp.shared_expert, name)), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_every_family_and_form_reads_to_one_layout(tmp_path, family, fused):
    raw, cfg = _model(family)
    want = random_model(cfg, seed=3)
    write_checkpoint(tmp_path, raw, checkpoint_tensors(want, fused=fused))
    with MoECheckpoint(tmp_path) as ckpt:
        assert ckpt.expert_format == ["fused" if fused else "per_expert"] * cfg.num_layers
        _assert_same(ckpt.read_all(), want)


def test_mixtral_w1_is_gate_w3_is_up_w2_is_down(tmp_path):
    # Written by hand with Mixtral's names, so the mapping is stated here, not derived.
    raw, cfg = _model("mixtral", layers=1, experts=2)
    want = random_model(cfg, seed=4)
    tensors = {k: v for k, v in checkpoint_tensors(want).items() if ".block_sparse_moe.experts." not in k}
    I = cfg.moe_intermediate_size  # noqa: E741
    gen = torch.Generator().manual_seed(0)
    w1, w3, w2 = (torch.randn(2, I, 24, generator=gen), torch.randn(2, I, 24, generator=gen),
                  torch.randn(2, 24, I, generator=gen))
    for e in range(2):
        tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] = w1[e]
        tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"] = w3[e]
        tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"] = w2[e]
    write_checkpoint(tmp_path, raw, tensors)
    moe = MoECheckpoint(tmp_path).moe(0)
    assert torch.equal(moe.w_gate_up[:, :I], w1) and torch.equal(moe.w_gate_up[:, I:], w3)
    assert torch.equal(moe.w_down, w2)
    assert moe.norm_topk_prob is True  # Mixtral always renormalises


@pytest.mark.parametrize("index", [True, False], ids=["index", "no_index"])
def test_sharded_checkpoint(tmp_path, index):
    raw, cfg = _model("qwen3_moe")
    want = random_model(cfg, seed=5)
    write_checkpoint(tmp_path, raw, checkpoint_tensors(want), shards=3, index=index)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    _assert_same(read_checkpoint(tmp_path), want)


def test_key_stored_twice_is_refused(tmp_path):
    raw, cfg = _model("qwen3_moe")
    tensors = checkpoint_tensors(random_model(cfg))
    write_checkpoint(tmp_path, raw, tensors, shards=2, index=False)
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.ones(24)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"model\.norm\.weight: stored twice"):
        MoECheckpoint(tmp_path)


def test_tied_embeddings_without_lm_head(tmp_path):
    raw, cfg = _model("qwen3_moe", tie_word_embeddings=True)
    want = random_model(cfg, seed=6)
    tensors = checkpoint_tensors(want)
    assert "lm_head.weight" not in tensors
    write_checkpoint(tmp_path, raw, tensors)
    got = read_checkpoint(tmp_path)
    assert torch.equal(got.lm_head, want.embed_tokens)


def test_dtype_cast_and_stored_dtype(tmp_path):
    raw, cfg = _model("olmoe")
    want = random_model(cfg, seed=7)
    write_checkpoint(tmp_path, raw, checkpoint_tensors(want), dtype=torch.bfloat16)
    assert MoECheckpoint(tmp_path).moe(1).w_down.dtype == torch.bfloat16
    got = MoECheckpoint(tmp_path, dtype=torch.float32).moe(1)
    assert got.w_down.dtype == torch.float32
    assert torch.equal(got.w_down, want.layers[1].moe.w_down.to(torch.bfloat16).float())


def test_transposed_fused_stack_is_refused(tmp_path):
    raw, cfg = _model("qwen3_moe")
    tensors = checkpoint_tensors(random_model(cfg), fused=True)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[key] = tensors[key].transpose(1, 2)  # [E, H, 2I], as qwen3_vl_moe stores it
    write_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(CheckpointShapeError) as exc:
        MoECheckpoint(tmp_path)
    assert exc.value.subject == key
    assert exc.value.expected == (4, 32, 24) and exc.value.found == (4, 24, 32)
    assert "expected (4, 32, 24), found (4, 24, 32)" in str(exc.value)


def test_missing_expert_is_refused(tmp_path):
    raw, cfg = _model("mixtral")
    tensors = checkpoint_tensors(random_model(cfg))
    del tensors["model.layers.0.block_sparse_moe.experts.3.w3.weight"]
    write_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(MissingTensorError, match=r"experts\.3\.w3\.weight: required tensor is missing"):
        MoECheckpoint(tmp_path)


def test_unconsumed_tensors_are_refused(tmp_path):
    raw, cfg = _model("qwen3_moe")
    tensors = checkpoint_tensors(random_model(cfg))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(20)
    tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(16, 24)
    write_checkpoint(tmp_path, raw, tensors)
    with pytest.raises(UnsupportedModelError, match=r"2 tensor\(s\) that the Qwen3-MoE layout has no place for"):
        MoECheckpoint(tmp_path)


@pytest.mark.parametrize(
    ("family", "over", "match"),
    [
        ("qwen3_moe", {"model_type": "dbrx"}, r"unsupported model family"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"dense MLP layers are not supported"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"dense MLP layers are not supported"),
        ("olmoe", {"attention_bias": True}, r"attention_bias: biases are not supported"),
        ("mixtral", {"hidden_act": "gelu"}, r"experts must use SiLU"),
    ],
)
def test_unsupported_models(family, over, match):
    raw = {**model_config_dict(family, **DIMS), **over}
    with pytest.raises(UnsupportedModelError, match=match):
        MoEModelConfig.from_dict(raw)


def test_config_field_variants(tmp_path):
    # Qwen3-MoE: transformers 5.17 writes num_local_experts, older configs num_experts.
    raw = model_config_dict("qwen3_moe", **DIMS)
    raw["num_local_experts"] = raw.pop("num_experts")
    assert MoEModelConfig.from_dict(raw).num_experts == 4
    # head_dim absent: hidden // heads. OLMoE's norm_topk_prob defaults to False.
    raw = model_config_dict("olmoe", **{**DIMS, "head_dim": None})
    raw.pop("norm_topk_prob")
    cfg = MoEModelConfig.from_dict(raw)
    assert cfg.head_dim == 12 and cfg.norm_topk_prob is False
    assert cfg.dense_shapes == {"q": (24, 24), "k": (24, 12), "v": (24, 12), "o": (24, 24)}
    # Mixtral renormalises whatever the config says.
    assert MoEModelConfig.from_dict(model_config_dict("mixtral", **DIMS, norm_topk_prob=False)).norm_topk_prob
    spec = cfg.layer_spec(max_loras=3, max_rank=8)
    assert (spec.H, spec.I, spec.E, spec.top_k, spec.R) == (24, 16, 4, 2, 8)


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, r"config\.json: not found"), ("{not json", r"not valid JSON"), ('{"model_type": "mixtral"}',
                                                                            r"hidden_size: must be an int >= 1")],
)
def test_bad_config_files(tmp_path, content, match):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointFormatError, match=match):
        read_model_config(tmp_path)


def test_no_safetensors_is_refused(tmp_path):
    raw, _ = _model("qwen3_moe")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointFormatError, match=r"no safetensors file"):
        MoECheckpoint(tmp_path)


def test_core_readers_import_neither_transformers_nor_peft():
    code = ("import sys, moelora_core.checkpoint, moelora_core.checkpoint.synthetic; "
            "bad = [m for m in ('transformers', 'peft') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pickled_checkpoint_weights_are_named_as_not_read(tmp_path):
    # Regression: only pytorch_model.bin (no safetensors) must say that .bin files are not read.
    raw, cfg = _model("qwen3_moe")
    write_checkpoint(tmp_path, raw, checkpoint_tensors(random_model(cfg, seed=2)))
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match=r"pytorch_model\.bin: pickled PyTorch weights are not read"):
        MoECheckpoint(tmp_path)
