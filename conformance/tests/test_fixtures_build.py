"""The fixtures builder (``docs/checkpoints.md``): what it writes, in which format, and that it
writes the same bytes every time.

Covers: the manifest lists every spec; models are on disk in the declared expert format with the
dims that make a wrong read fail loudly (H != 2I except the H == 2I model); adapters are on disk in
peft's layouts (fused target_parameters, legacy per-expert with gate_A != up_A, fp16/bf16
storage); a second build through the CLI (``make-fixtures``) gives byte-identical files.
"""

import hashlib
import json

import pytest
from safetensors import safe_open

from moelora_conformance.cli import main
from moelora_conformance.fixtures import ADAPTERS, BAD_ADAPTERS, LAYOUT_ADAPTERS, MODELS
from moelora_conformance.fixtures.specs import ALL_ADAPTERS, ALL_MODELS, DEEPSEEK_V3, FP8_MODELS, GPT_OSS, SHARED


def _keys(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def test_manifest_lists_every_spec(fixture_set):
    m = fixture_set.manifest
    # MODELS, GPT-OSS and DeepSeek-V3, and the fp8 copies (listed with quantized_from)
    assert sorted(m["models"]) == sorted([s.name for s in ALL_MODELS] + [s.name for s in FP8_MODELS])
    assert sorted(m["adapters"]) == sorted(s.name for s in ALL_ADAPTERS)
    assert [s for s in ALL_MODELS if s not in MODELS] == [GPT_OSS, DEEPSEEK_V3]
    assert all(s in ALL_ADAPTERS for s in ADAPTERS)
    assert sorted(m["bad_adapters"]) == sorted(s.name for s in BAD_ADAPTERS)
    assert sorted(m["layout_adapters"]) == sorted(s.name for s in LAYOUT_ADAPTERS)
    for name, entry in m["layout_adapters"].items():  # peft cannot load these: listed apart
        # DeepSeek-V3's shared-expert / dense-MLP adapter: per-expert experts, modules peft refuses to wrap
        layouts = ("per_expert",) if entry["model"] == DEEPSEEK_V3.name else ("shared_outer", "fully_shared")
        assert entry["peft_loadable"] is False and entry["layout"] in layouts, name
        assert entry["encoding"] in ("packed", "fused") and set(entry["modules"]) == {"0", "1"}, name
        assert (fixture_set.layout_adapter_dir(name) / "adapter_model.safetensors").is_file()
    assert {e["family"] for e in m["models"].values()} == {"qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss",
                                                           "deepseek_v3"}
    for name, entry in m["adapters"].items():
        assert entry["modules"], name
        assert set(entry["modules"]) == {"0", "1"}, name
        for modules in entry["modules"].values():
            for info in modules.values():
                assert info["rank"] >= 1 and info["scaling"] > 0, name
    for name in m["adapters"]:
        assert (fixture_set.adapter_dir(name) / "adapter_config.json").is_file()


def test_gpt_oss_on_disk(fixture_set):
    # save_pretrained's GPT-OSS keys: x @ W stacks with interleaved gate/up columns, biases, sinks
    keys = _keys(fixture_set.model_dir(GPT_OSS.name) / "model.safetensors")
    H, I, E = GPT_OSS.hidden, GPT_OSS.inter, GPT_OSS.experts  # noqa: E741
    assert H not in (I, 2 * I)
    p = "model.layers.1"
    assert keys[f"{p}.mlp.experts.gate_up_proj"][0] == (E, H, 2 * I)
    assert keys[f"{p}.mlp.experts.gate_up_proj_bias"][0] == (E, 2 * I)
    assert keys[f"{p}.mlp.experts.down_proj"][0] == (E, I, H)
    assert keys[f"{p}.mlp.experts.down_proj_bias"][0] == (E, H)
    assert keys[f"{p}.mlp.router.bias"][0] == (E,)
    assert keys[f"{p}.self_attn.sinks"][0] == (GPT_OSS.heads,)
    assert keys[f"{p}.self_attn.o_proj.bias"][0] == (H,)
    config = json.loads((fixture_set.model_dir(GPT_OSS.name) / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["rope_type"] == "default"


def test_deepseek_v3_on_disk(fixture_set):
    # save_pretrained's DeepSeek-V3 keys: a dense MLP on layer 0; on layer 1 per-expert experts, the
    # router's nonzero correction bias, ungated shared experts; MLA everywhere; YaRN in the config
    spec, d = DEEPSEEK_V3, DEEPSEEK_V3.deepseek
    directory = fixture_set.model_dir(spec.name)
    keys = _keys(directory / "model.safetensors")
    H, I, E = spec.hidden, spec.inter, spec.experts  # noqa: E741
    assert keys["model.layers.0.mlp.gate_proj.weight"][0] == (d.dense_inter, H)
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in keys)
    assert keys["model.layers.1.mlp.experts.7.down_proj.weight"][0] == (H, I)
    assert keys["model.layers.1.mlp.shared_experts.gate_proj.weight"][0] == (I * d.n_shared_experts, H)
    assert not any("shared_expert_gate" in k for k in keys)
    for li in (0, 1):
        assert keys[f"model.layers.{li}.self_attn.q_a_proj.weight"][0] == (d.q_lora_rank, H)
        assert keys[f"model.layers.{li}.self_attn.kv_b_proj.weight"][0] == (
            spec.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.shape == (E,) and float(bias.abs().min()) > 0  # nonzero: dropping or misusing it shows
    config = json.loads((directory / "config.json").read_text())
    assert config["n_group"] > 1 and config["topk_group"] < config["n_group"]
    assert config["routed_scaling_factor"] != 1 and config["first_k_dense_replace"] == 1
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_interleave"] is True


@pytest.mark.parametrize("spec", MODELS, ids=lambda s: s.name)
def test_model_on_disk(fixture_set, spec):
    keys = _keys(fixture_set.model_dir(spec.name) / "model.safetensors")
    H, I, E = spec.hidden, spec.inter, spec.experts  # noqa: E741
    if spec.name == "qwen3_moe_h2i":
        assert H == 2 * I  # orientation must come from the format
        assert "lm_head.weight" not in keys  # tied embeddings
    else:
        assert H not in (I, 2 * I)  # a transposed or swapped read has the wrong shape
        assert keys["lm_head.weight"][0] == (spec.vocab, H)
    q_out = keys["model.layers.0.self_attn.q_proj.weight"][0]
    assert q_out[0] != H or spec.family == "olmoe"  # heads·head_dim != H, so a transposed q fails
    if spec.expert_format == "fused":
        assert keys["model.layers.1.mlp.experts.gate_up_proj"][0] == (E, 2 * I, H)
        assert keys["model.layers.1.mlp.experts.down_proj"][0] == (E, H, I)
        assert not any(".experts.0." in k for k in keys)
    elif spec.family == "mixtral":
        assert keys[f"model.layers.1.block_sparse_moe.experts.{E - 1}.w1.weight"][0] == (I, H)
        assert keys["model.layers.1.block_sparse_moe.experts.0.w2.weight"][0] == (H, I)
        assert keys["model.layers.1.block_sparse_moe.gate.weight"][0] == (E, H)
    else:
        assert keys[f"model.layers.1.mlp.experts.{E - 1}.up_proj.weight"][0] == (I, H)
        assert keys["model.layers.1.mlp.experts.0.down_proj.weight"][0] == (H, I)
    shared = {k: shape for k, (shape, _) in keys.items() if ".shared_expert" in k}
    if spec.shared_inter is None:
        assert not shared
    else:  # Qwen2-MoE: the shared expert, wider than H and than the routed experts' 2I
        assert spec.shared_inter not in (H, I, 2 * I)
        assert shared["model.layers.1.mlp.shared_expert.gate_proj.weight"] == (spec.shared_inter, H)
        assert shared["model.layers.1.mlp.shared_expert.down_proj.weight"] == (H, spec.shared_inter)
        assert shared["model.layers.1.mlp.shared_expert_gate.weight"] == (1, H)
        assert keys["model.layers.1.self_attn.v_proj.bias"][0] == (spec.kv_heads * spec.head_dim,)  # qkv_bias
        assert "model.layers.1.self_attn.o_proj.bias" not in keys
    assert {dtype for _, dtype in keys.values()} == {"F32"}


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_adapter_on_disk(fixture_set, spec):
    keys = _keys(fixture_set.adapter_dir(spec.name) / "adapter_model.safetensors")
    config = json.loads((fixture_set.adapter_dir(spec.name) / "adapter_config.json").read_text())
    assert config["init_lora_weights"] is False and config["peft_type"] == "LORA"
    assert {dtype for _, dtype in keys.values()} == {{"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[
        spec.stored_dtype]}
    assert config["use_rslora"] is spec.use_rslora
    fused = [k for k in keys if ".mlp.experts.lora_" in k or ".experts.base_layer." in k]
    per_expert = [k for k in keys if ".experts.0." in k]
    shared = {k for k in keys if ".mlp.shared_expert." in k}
    assert len(shared) == 2 * 2 * len(set(spec.dense) & set(SHARED))  # A and B, two layers
    if spec.format == "fused":
        assert bool(fused) == bool(spec.experts) and not per_expert
        assert sorted(config["target_parameters"] or []) == sorted(f"mlp.experts.{p}" for p in spec.experts)
        nested = any("experts.base_layer" in k for k in keys)
        assert nested == (len(spec.experts) == 2)  # gate_up is the inner wrapper when both are targeted
    else:
        assert per_expert and not fused
        assert config["target_parameters"] is None


def test_legacy_adapter_has_distinct_gate_and_up_a(fixture_set):
    from safetensors.torch import load_file

    for spec in ADAPTERS:
        if spec.format != "per_expert":
            continue
        state = load_file(str(fixture_set.adapter_dir(spec.name) / "adapter_model.safetensors"))
        gate = next(v for k, v in state.items() if k.endswith((".0.gate_proj.lora_A.weight", ".0.w1.lora_A.weight")))
        up = next(v for k, v in state.items() if k.endswith((".0.up_proj.lora_A.weight", ".0.w3.lora_A.weight")))
        assert gate.shape == up.shape and not gate.equal(up), spec.name


def _digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_make_fixtures_cli_is_deterministic(fixture_set, tmp_path, capsys):
    assert main(["make-fixtures", str(tmp_path / "again")]) == 0
    assert "built 12 models, 24 adapters, 5 shared-outer / fully shared adapters, 16 bad adapters" in \
        capsys.readouterr().out
    first, second = _digest(fixture_set.root), _digest(tmp_path / "again")
    assert first.keys() == second.keys()
    differ = [k for k in first if first[k] != second[k]]
    assert not differ, f"{len(differ)} files differ between two builds, e.g. {differ[:3]}"
