"""Adapter refusals: one error class per kind, a message naming the adapter, the key or
module, expected vs found; detected from the config and from the keys alike.

The real-format bad adapters (built by peft) are checked in conformance/tests/test_fixtures_bad_adapters.py.
"""

import json

import pytest
import torch

from moelora_core import AdapterError
from moelora_core.checkpoint import (
    ADAPTER_REFUSALS,
    AdapterFormatError,
    DoRAError,
    ModelMismatchError,
    MoEModelConfig,
    NonFiniteWeightError,
    RankTooLargeError,
    ShapeMismatchError,
    UnmatchedKeysError,
    UnsupportedTargetError,
    VocabularyTargetError,
    read_adapter,
)
from moelora_core.checkpoint.synthetic import adapter_tensors, model_config_dict, write_adapter

DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)
PRE = "base_model.model.model.layers"


def _cfg(family="qwen3_moe", **over):
    return MoEModelConfig.from_dict(model_config_dict(family, **{**DIMS, **over}))


def _good(cfg, r=2, fmt="fused"):
    gen = torch.Generator().manual_seed(0)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    a = torch.randn(E, r, H, generator=gen)
    layer = {"gate": (a, torch.randn(E, I, r, generator=gen)),
             "up": (a.clone() if fmt == "fused" else torch.randn(E, r, H, generator=gen),
                    torch.randn(E, I, r, generator=gen)),
             "down": (torch.randn(E, r, I, generator=gen), torch.randn(E, H, r, generator=gen)),
             "q": (torch.randn(r, H, generator=gen), torch.randn(20, r, generator=gen)),
             "k": (torch.randn(r, H, generator=gen), torch.randn(10, r, generator=gen))}
    tensors, targets = adapter_tensors(cfg, {0: layer, 1: layer}, expert_format=fmt)
    return tensors, {**targets, "r": r, "lora_alpha": 2 * r,
                     "target_parameters": targets["target_parameters"] or None}


def _refused(tmp_path, cfg, tensors, config, kind, *fragments, **kwargs):
    path = write_adapter(tmp_path / "bad", tensors, config)
    with pytest.raises(kind) as exc:
        read_adapter(path, cfg, **kwargs)
    assert type(exc.value) is kind
    msg = str(exc.value)
    assert msg.startswith("adapter 'bad': "), msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return exc.value


def test_every_refusal_is_an_adapter_error():
    assert len(set(ADAPTER_REFUSALS)) == 10
    for kind in ADAPTER_REFUSALS:
        assert issubclass(kind, AdapterError) and issubclass(kind, ValueError)


def test_dora_from_config_and_from_keys(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, tensors, {**conf, "use_dora": True}, DoRAError, "use_dora", "found True")
    key = f"{PRE}.1.self_attn.q_proj.lora_magnitude_vector"
    err = _refused(tmp_path, cfg, {**tensors, key: torch.ones(20)}, conf, DoRAError, key, "1 key(s)")
    assert err.subject == key


@pytest.mark.parametrize(
    ("extra_conf", "extra_keys", "fragment"),
    [
        ({"trainable_token_indices": {"embed_tokens": [1]}}, {}, "trainable_token_indices"),
        ({"target_modules": ["q_proj", "lm_head"]}, {}, "lm_head"),
        ({"modules_to_save": ["embed_tokens"]}, {}, "embed_tokens"),
        ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(2, 32)}, "lora_embedding_A"),
        ({}, {"base_model.model.lm_head.weight": torch.zeros(32, 24)}, "base_model.model.lm_head.weight"),
        ({}, {"base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": torch.zeros(1, 24)},
         "trainable_tokens_delta"),
    ],
)
def test_vocabulary_targets(tmp_path, extra_conf, extra_keys, fragment):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, {**tensors, **extra_keys}, {**conf, **extra_conf}, VocabularyTargetError, fragment)


def test_added_tokens_file(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    path = write_adapter(tmp_path / "bad", tensors, conf)
    (path / "added_tokens.json").write_text(json.dumps({"<tool>": 32}))
    with pytest.raises(VocabularyTargetError, match=r"added_tokens\.json: the adapter adds tokens.*<tool>"):
        read_adapter(path, cfg)


def test_unmatched_keys_lists_five_and_counts(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    extra = {f"{PRE}.{li}.self_attn.rope_{i}.lora_A.weight": torch.zeros(2, 24) for li in (0, 1) for i in range(4)}
    err = _refused(tmp_path, cfg, {**tensors, **extra}, conf, UnmatchedKeysError, "8 key(s)", "(+3 more)",
                   "match no module")
    assert err.subject.count("rope_") == 5


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        (f"{PRE}.0.mlp.gate.lora_A.weight", "mlp.gate.lora_A"),  # the router
        (f"{PRE}.1.self_attn.q_norm.lora_A.weight", "q_norm"),
        (f"{PRE}.0.post_attention_layernorm.lora_A.weight", "post_attention_layernorm"),
    ],
)
def test_unsupported_targets_from_keys(tmp_path, key, fragment):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, {**tensors, key: torch.zeros(2, 24)}, conf, UnsupportedTargetError, fragment,
             "modules moelora does not serve")


@pytest.mark.parametrize(
    ("extra_conf", "fragment"),
    [
        ({"target_modules": ["q_proj", "gate"]}, "['gate']"),
        ({"target_parameters": ["mlp.gate.weight"]}, "mlp.gate.weight"),
        ({"modules_to_save": ["score"]}, "modules_to_save"),
    ],
)
def test_unsupported_targets_from_config(tmp_path, extra_conf, fragment):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, tensors, {**conf, **extra_conf}, UnsupportedTargetError, fragment)


def test_shape_mismatch_names_key_expected_found(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    key = f"{PRE}.1.mlp.experts.base_layer.lora_B.weight"
    tensors[key] = tensors[key][:, :-1]
    err = _refused(tmp_path, cfg, tensors, conf, ShapeMismatchError, key, "expected (32, 8), found (32, 7)")
    assert (err.expected, err.found) == ((32, 8), (32, 7))


def test_rank_from_config_must_match_file(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg, r=2)
    _refused(tmp_path, cfg, tensors, {**conf, "rank_pattern": {"q_proj": 3}}, ShapeMismatchError,
             "self_attn.q_proj.lora_A.weight", "the file's rank differs from the rank the config gives layer 0 q",
             "expected 3, found 2")


def test_rank_above_pool(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg, r=4)
    err = _refused(tmp_path, cfg, tensors, conf, RankTooLargeError, "layer 0 down", "expected <= 3", "found 4",
                   max_rank=3)
    assert err.found == 4


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite(tmp_path, value):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    key = f"{PRE}.1.self_attn.k_proj.lora_A.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][1, 7] = value
    counts = "1 NaN and 0 Inf" if value != value else "0 NaN and 1 Inf"
    _refused(tmp_path, cfg, tensors, conf, NonFiniteWeightError, key, counts, "non-finite at (1, 7)")


def test_model_mismatch_type(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, tensors, {**conf, "auto_mapping": {"base_model_class": "OlmoeForCausalLM"}},
             ModelMismatchError, "expected Qwen3MoeForCausalLM, found OlmoeForCausalLM")


def test_model_mismatch_other_family_names(tmp_path):
    mixtral = _cfg("mixtral")
    tensors, conf = _good(mixtral, fmt="per_expert")  # w1/w3/w2 under block_sparse_moe
    _refused(tmp_path, _cfg("qwen3_moe"), tensors, {**conf, "target_modules": ["q_proj"]}, ModelMismatchError,
             "block_sparse_moe.experts")
    # the config naming Mixtral's experts does not change that: the keys are another model's
    _refused(tmp_path, _cfg("qwen3_moe"), tensors, conf, ModelMismatchError, "keys made for another model",
             "block_sparse_moe.experts.0.w1")


def test_other_family_expert_names_without_keys_are_served_with_a_note(tmp_path):
    # peft 0.21.2 wraps nothing for target_modules entries that name no module of the model (w1 on a
    # Qwen3-MoE; gate_proj on a transformers-5 Mixtral) and applies the rest of the file: so does moelora,
    # and it says which entries added nothing (test_peft_formats.py writes such files with peft).
    cfg = _cfg()
    tensors, conf = _good(cfg)
    dense = {k: v for k, v in tensors.items() if ".self_attn." in k}
    path = write_adapter(tmp_path / "ad", dense, {**conf, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                            "w1", "w2", "w3"],
                                                  "target_parameters": None})
    read = read_adapter(path, cfg)
    assert read.modules() and set(read.modules()) <= {"q", "k", "v", "o"}
    assert len(read.config.notes) == 1 and "['w1', 'w2', 'w3']" in read.config.notes[0]
    assert "add nothing" in read.config.notes[0]


@pytest.mark.parametrize(
    ("over", "fragment"),
    [({"hidden": 32, "head_dim": 16}, "hidden size: the adapter was made for another model (all its factors agree) "
                                      "(expected 24, found 32)"),
     ({"inter": 8}, "expert intermediate size: the adapter was made for another model (all its factors agree) "
                    "(expected 16, found 8)"),
     ({"experts": 8}, "number of experts: the adapter was made for another model (all its factors agree) "
                      "(expected 4, found 8)")],
)
def test_model_mismatch_dims(tmp_path, over, fragment):
    other = _cfg(**over)
    tensors, conf = _good(other)
    _refused(tmp_path, _cfg(), tensors, conf, ModelMismatchError, fragment)


def test_model_mismatch_layer_and_expert_index(tmp_path):
    cfg = _cfg()
    tensors, conf = _good(cfg, fmt="per_expert")
    deep = {k.replace(f"{PRE}.1.", f"{PRE}.5."): v for k, v in tensors.items()}
    _refused(tmp_path, cfg, deep, conf, ModelMismatchError, f"{PRE}.5.", "2-layer, 4-expert Qwen3-MoE")
    wide = {**tensors, f"{PRE}.0.mlp.experts.4.gate_proj.lora_A.weight": torch.zeros(2, 24)}
    _refused(tmp_path, cfg, wide, conf, ModelMismatchError, "experts.4.gate_proj")


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda t, c: (t, {**c, "peft_type": "IA3"}), "not a LoRA adapter (expected 'LORA', found 'IA3')"),
        (lambda t, c: (t, {**c, "lora_bias": True}), "lora_bias: not supported"),
        (lambda t, c: (t, {**c, "use_qalora": True}), "LoRA variant not supported"),
        (lambda t, c: (t, {**c, "r": 0}), "invalid LoRA settings"),
        (lambda t, c: ({**t, f"{PRE}.0.self_attn.q_proj.lora_B.bias": torch.zeros(20)}, c), "LoRA bias"),
        (lambda t, c: ({k: v for k, v in t.items() if not k.endswith("k_proj.lora_B.weight")}, c),
         "has no partner lora_B"),
        (lambda t, c: ({}, c), "holds no LoRA factor"),
        (lambda t, c: (t, {**c, "target_parameters": None}), "does not say which parameter"),
    ],
)
def test_format_errors(tmp_path, edit, fragment):
    cfg = _cfg()
    tensors, conf = edit(*_good(cfg))
    if fragment == "does not say which parameter":
        tensors = {k: v for k, v in tensors.items() if "base_layer" not in k}
    _refused(tmp_path, cfg, tensors, conf, AdapterFormatError, fragment)


def test_missing_files(tmp_path):
    cfg = _cfg()
    with pytest.raises(AdapterFormatError, match=r"adapter_config\.json: not found"):
        read_adapter(tmp_path, cfg)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    with pytest.raises(AdapterFormatError, match=r"no safetensors file"):
        read_adapter(tmp_path, cfg)


# --- adversarial-input findings ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra_conf", "fragments"),
    [
        ({"lora_alpha": 1e40}, ("adapter_config.json", "σ = α/r = 1e+40/2 = 5e+39 overflows fp32")),
        ({"alpha_pattern": {"q_proj": 1e40}}, ("layer 0 q (model.layers.0.self_attn.q_proj)", "overflows fp32")),
    ],
)
def test_sigma_overflowing_fp32_is_refused_on_read(tmp_path, extra_conf, fragments):
    # Regression: lora_alpha 1e40 gave σ = 1.25e39, a finite Python float that is Inf in the pools'
    # fp32 σ tables; read_adapter accepted it and load_slot failed half-way.
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, tensors, {**conf, **extra_conf}, AdapterFormatError, *fragments)


@pytest.mark.parametrize(
    ("extra_conf", "kind", "fragments"),
    [
        # Regression: [1, 2] raised a raw AttributeError; string lists were iterated by character.
        ({"target_modules": [1, 2]}, AdapterFormatError,
         ("adapter_config.json target_modules", "must be a list of module names or one regular-expression string")),
        ({"target_modules": "q_proj("}, AdapterFormatError, ("target_modules", "not a valid regular expression")),
        ({"exclude_modules": {"q_proj": 1}}, AdapterFormatError, ("adapter_config.json exclude_modules",)),
        ({"target_parameters": "mlp.experts.gate_up_proj"}, AdapterFormatError,
         ("adapter_config.json target_parameters", "a string is not a list", "found 'mlp.experts.gate_up_proj'")),
        ({"layers_to_transform": ["0"]}, AdapterFormatError, ("layers_to_transform", "list of layer indices")),
        ({"layers_to_transform": True}, AdapterFormatError, ("layers_to_transform",)),
        ({"layers_pattern": 3}, AdapterFormatError, ("layers_pattern",)),
        ({"modules_to_save": "lm_head"}, VocabularyTargetError, ("modules_to_save", "found ['lm_head']")),
        ({"modules_to_save": "score"}, UnsupportedTargetError, ("modules_to_save", "found ['score']")),
        ({"modules_to_save": 7}, AdapterFormatError, ("modules_to_save", "must be a list")),
    ],
)
def test_config_fields_of_the_wrong_type_are_named(tmp_path, extra_conf, kind, fragments):
    cfg = _cfg()
    tensors, conf = _good(cfg)
    _refused(tmp_path, cfg, tensors, {**conf, **extra_conf}, kind, *fragments)


@pytest.mark.parametrize(("r_conf", "found"), [(1, 2), (4, 2)])
def test_config_rank_other_than_the_files_names_the_rank(tmp_path, r_conf, found):
    # Regression: r = 4 for a file of rank 8 was reported as "number of experts (expected 6,
    # found 12)": the fused lora_A rows are E·r, and the reader divided by the config's r.
    cfg = _cfg()
    tensors, conf = _good(cfg, r=2)
    err = _refused(tmp_path, cfg, tensors, {**conf, "r": r_conf, "lora_alpha": 2 * r_conf}, ShapeMismatchError,
                   "rank", f"expected {r_conf}, found {found}")
    assert "number of experts" not in str(err)


def test_expert_only_adapter_with_another_rank_names_both_readings(tmp_path):
    # Regression (without dense factors to show the file's rank): E'·r' rows fit either another
    # expert count or another rank, and the message says both.
    cfg = _cfg()
    tensors, conf = _good(cfg, r=2)
    tensors = {k: v for k, v in tensors.items() if "self_attn" not in k}
    _refused(tmp_path, cfg, tensors, {**conf, "r": 1, "lora_alpha": 2, "target_modules": []}, ModelMismatchError,
             "number of experts", "expected 4, found 8", "or the file's expert rank is 2 where the config says [1]")


@pytest.mark.parametrize("stem", ["adapter_model.bin", "adapter_model.pt"])
def test_pickled_adapter_weights_are_named_as_not_read(tmp_path, stem):
    # Regression: a folder with only adapter_model.bin said "no safetensors file", not why.
    cfg = _cfg()
    tensors, conf = _good(cfg)
    path = write_adapter(tmp_path / "bad", tensors, conf)
    (path / "adapter_model.safetensors").unlink()
    torch.save(tensors, path / stem)
    with pytest.raises(AdapterFormatError, match=rf"{stem}: pickled PyTorch weights are not read.*safetensors"):
        read_adapter(path, cfg)
