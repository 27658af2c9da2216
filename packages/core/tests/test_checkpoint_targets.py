"""Adapter keys against the config that should have produced them.

peft 0.21.2 wraps the modules its config targets and loads the file's keys into them; a key for a
module it did not wrap is dropped without a warning. moelora refuses such keys instead of serving
them (they were served before: target_modules=["k_proj"] with q/v/o keys in the file). Covers:

- target_modules (list, regex string, "all-linear"), exclude_modules, layers_to_transform /
  layers_pattern on dense and legacy per-expert keys, with peft's own matching function as the
  reference for the rules (parity test, skipped without peft);
- fused ``target_parameters`` keys, which peft 0.21.2 wraps in every layer whatever
  exclude_modules / layers_to_transform say: served, as peft serves them;
- keys that name a module with a non-canonical index (``layers.00``, ``layers.١``): refused, in
  adapters and base checkpoints alike (an alias overwrote the real factor);
- keys that carry an adapter name (``lora_A.default.weight``): refused with that reason;
- ``target_parameters`` entries by peft's "equals or ends with" rule (``expert_parameter``): the
  short names peft writes (``gate_up_proj``), partial and full paths, one layer's path; another
  parameter (the router's ``gate.weight``, a bias) or a misspelt path is not an expert parameter.
"""

import json
import types

import pytest
import torch

from moelora_core.checkpoint import (
    AdapterFormatError,
    CheckpointFormatError,
    MoECheckpoint,
    MoEModelConfig,
    read_adapter,
)
from moelora_core.checkpoint.peft_config import expert_parameter, parse_adapter_config
from moelora_core.checkpoint.peft_targets import targets_module
from moelora_core.checkpoint.synthetic import (
    adapter_tensors,
    checkpoint_tensors,
    model_config_dict,
    random_model,
    write_adapter,
    write_checkpoint,
)

DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)
PRE = "base_model.model.model.layers"
LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def _cfg(family="qwen3_moe"):
    return MoEModelConfig.from_dict(model_config_dict(family, **DIMS))


def _layer(cfg, gen, modules, r=2, fused=True):
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    a = torch.randn(E, r, H, generator=gen)
    all_ = {"gate": (a, torch.randn(E, I, r, generator=gen)),
            "up": (a.clone() if fused else torch.randn(E, r, H, generator=gen), torch.randn(E, I, r, generator=gen)),
            "down": (torch.randn(E, r, I, generator=gen), torch.randn(E, H, r, generator=gen)),
            "q": (torch.randn(r, H, generator=gen), torch.randn(20, r, generator=gen)),
            "k": (torch.randn(r, H, generator=gen), torch.randn(10, r, generator=gen)),
            "v": (torch.randn(r, H, generator=gen), torch.randn(10, r, generator=gen))}
    return {m: all_[m] for m in modules}


def _write(tmp_path, cfg, layers, conf_over, *, fmt="fused", name="ad", edit=None):
    gen = torch.Generator().manual_seed(0)
    per_layer = {li: _layer(cfg, gen, mods, fused=fmt == "fused") for li, mods in layers.items()}
    tensors, targets = adapter_tensors(cfg, per_layer, expert_format=fmt)
    if edit is not None:
        tensors = edit(tensors)
    conf = {**targets, "r": 2, "lora_alpha": 4, "target_parameters": targets["target_parameters"] or None,
            **conf_over}
    return write_adapter(tmp_path / name, tensors, conf)


DENSE = ("q", "k", "v")
MOE = ("gate", "up", "down")


@pytest.mark.parametrize(
    ("conf", "fragments"),
    [
        # cases: peft wraps none of these modules and drops their keys
        ({"target_modules": ["k_proj"]}, ("layers.0.self_attn.q_proj.lora_A.weight", "target_modules=['k_proj']")),
        ({"exclude_modules": ["q_proj"]}, ("layers.0.self_attn.q_proj", "exclude_modules=['q_proj']")),
        ({"layers_to_transform": [0], "layers_pattern": "layers"},
         ("layers.1.self_attn.k_proj", "layers_to_transform=[0]")),
        ({"layers_to_transform": 0}, ("layers.1.self_attn.q_proj", "layers_to_transform=0")),
        ({"target_modules": r".*\.[qv]_proj"}, ("layers.0.self_attn.k_proj",)),
        ({"exclude_modules": r"model\.layers\.1\..*"}, ("layers.1.self_attn.q_proj",)),
        ({"target_modules": []}, ("12 key(s)",)),
        ({"target_modules": None}, ("target_modules=None",)),
    ],
)
def test_keys_of_modules_the_config_does_not_target_are_refused(tmp_path, conf, fragments):
    cfg = _cfg()
    path = _write(tmp_path, cfg, {0: DENSE + MOE, 1: DENSE + MOE}, conf)
    with pytest.raises(AdapterFormatError) as exc:
        read_adapter(path, cfg)
    msg = str(exc.value)
    assert "the config does not target" in msg and "peft would not load them" in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


@pytest.mark.parametrize(
    "conf",
    [
        {"target_modules": "all-linear"},
        {"target_modules": "ALL-LINEAR"},
        {"target_modules": r"model\.layers\.\d+\.self_attn\.[qkv]_proj"},
        {"target_modules": ["self_attn.q_proj", "k_proj", "model.layers.0.self_attn.v_proj", "v_proj"]},
        {"exclude_modules": ["o_proj"]},  # excludes nothing the file holds
        {"layers_to_transform": [1, 0]},
    ],
)
def test_keys_the_config_targets_are_read(tmp_path, conf):
    cfg = _cfg()
    path = _write(tmp_path, cfg, {0: DENSE + MOE, 1: DENSE + MOE}, conf)
    ad = read_adapter(path, cfg)
    assert all(set(layer) == {"q", "k", "v", "gate", "up", "down"} for layer in ad.layers)


@pytest.mark.parametrize("conf", [{"layers_to_transform": [0]}, {"exclude_modules": ["experts"]},
                                  {"exclude_modules": r".*\.layers\.1\..*experts"}])
def test_fused_expert_keys_follow_peft_which_ignores_layer_and_exclude_filters(tmp_path, conf):
    # peft 0.21.2 applies exclude_modules and layers_to_transform to target_modules only; its
    # target_parameters wrap mlp.experts in every layer, so those keys are loaded and served.
    cfg = _cfg()
    path = _write(tmp_path, cfg, {0: DENSE + MOE, 1: MOE}, conf)
    ad = read_adapter(path, cfg)
    assert set(ad.layers[1]) == set(MOE) and set(ad.layers[0]) == set(DENSE + MOE)


def test_legacy_per_expert_keys_outside_layers_to_transform_are_refused(tmp_path):
    cfg = _cfg()
    path = _write(tmp_path, cfg, {0: ("gate", "up", "down"), 1: ("down",)}, {"layers_to_transform": [0]},
                  fmt="per_expert")
    with pytest.raises(AdapterFormatError, match=r"layers\.1\.mlp\.experts\.0\.down_proj.*the config does not target"):
        read_adapter(path, cfg)


PARITY_CONFIGS = [
    {"target_modules": ["q_proj", "gate_proj"]},
    {"target_modules": ["self_attn.q_proj"], "exclude_modules": ["layers.1.self_attn.q_proj"]},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": r".*\.k_proj"},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": 0, "layers_pattern": "layers"},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1], "layers_pattern": ["h", "layers"]},
    {"target_modules": ["q_proj", "model.layers.0.self_attn.k_proj"], "layers_to_transform": [1]},
    {"target_modules": r".*layers\.[01]\.self_attn\.(q|v)_proj"},
    {"target_modules": r".*experts\.\d+\.(gate|up)_proj", "exclude_modules": ["layers.0.mlp.experts.1.up_proj"]},
    {"target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj"]},
    {"target_modules": None, "target_parameters": ["mlp.experts.down_proj"]},
]
PARITY_PATHS = [f"model.layers.{li}.self_attn.{p}_proj" for li in (0, 1) for p in "qkv"] + [
    f"model.layers.{li}.mlp.experts.{e}.{leaf}" for li in (0, 1) for e in (0, 1) for leaf in ("gate_proj", "up_proj",
                                                                                              "down_proj")]


@pytest.mark.parametrize("raw", PARITY_CONFIGS, ids=lambda raw: json.dumps(raw)[:60])
def test_targeting_rules_equal_peft_check_target_module_exists(raw):
    tuners_utils = pytest.importorskip("peft.tuners.tuners_utils")
    full = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "exclude_modules": None, "layers_to_transform": None,
            "layers_pattern": None, "modules_to_save": None, "target_parameters": None, **raw}
    ours = parse_adapter_config(full, name="parity", supported_leaves=LEAVES)
    theirs = types.SimpleNamespace(**{k: full[k] for k in ("target_modules", "exclude_modules", "layers_to_transform",
                                                            "layers_pattern", "modules_to_save",
                                                            "target_parameters")})
    for path in PARITY_PATHS:
        want = bool(tuners_utils.check_target_module_exists(theirs, path))
        want = want and type(tuners_utils.check_target_module_exists(theirs, path)).__name__ != "_ExcludedModule"
        assert targets_module(ours, path) == want, (path, raw)


# --- aliases: one module named twice ----------------------------------------------------------


def _alias(old, new, value=None):
    def edit(tensors):
        out = dict(tensors)
        key = next(k for k in tensors if old in k)
        out[key.replace(old, new)] = tensors[key] if value is None else torch.full_like(tensors[key], value)
        if value is None:
            del out[key]
        return out
    return edit


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        # layers.00 beside layers.0: the alias (B = 5.0) overwrote the real factor; peft ignores it
        (_alias("layers.0.self_attn.q_proj.lora_B", "layers.00.self_attn.q_proj.lora_B", 5.0),
         "layers.00.self_attn.q_proj.lora_B.weight"),
        # Arabic-Indic one (U+0661) read as layer 1 by int() and by a Unicode \\d
        (lambda t: _alias("layers.1.self_attn.q_proj.lora_B", "layers.\u0661.self_attn.q_proj.lora_B")(
            _alias("layers.1.self_attn.q_proj.lora_A", "layers.\u0661.self_attn.q_proj.lora_A")(t)),
         "layers.\u0661.self_attn.q_proj"),
        (_alias("experts.1.gate_proj.lora_A", "experts.01.gate_proj.lora_A"), "experts.01.gate_proj"),
    ],
)
def test_non_canonical_indices_are_refused(tmp_path, edit, fragment):
    cfg = _cfg()
    fmt = "per_expert" if "experts" in fragment else "fused"
    path = _write(tmp_path, cfg, {0: DENSE + MOE, 1: DENSE + MOE}, {}, fmt=fmt, edit=edit)
    with pytest.raises(AdapterFormatError) as exc:
        read_adapter(path, cfg)
    msg = str(exc.value)
    assert fragment in msg and "non-canonical index" in msg, msg


def test_keys_with_an_adapter_name_are_refused_with_that_reason(tmp_path):
    # Regression: lora_A.default.weight keys (a model state_dict, not save_pretrained output) were
    # refused as "LoRA on modules moelora does not serve (router, norms...)" while naming q_proj.
    cfg = _cfg()

    def named(tensors):
        return {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
                v for k, v in tensors.items()}

    path = _write(tmp_path, cfg, {0: DENSE + MOE, 1: DENSE + MOE}, {}, edit=named)
    with pytest.raises(AdapterFormatError) as exc:
        read_adapter(path, cfg)
    msg = str(exc.value)
    assert "adapter name 'default'" in msg and "save_pretrained" in msg and "does not serve" not in msg, msg


@pytest.mark.parametrize(("old", "new"), [("experts.0.up_proj", "experts.00.up_proj"),
                                          ("layers.1.", "layers.\u0661."), ("layers.1.", "layers.01.")])
def test_base_checkpoint_refuses_non_canonical_indices_like_the_adapter_reader(tmp_path, old, new):
    raw = model_config_dict("qwen3_moe", **DIMS)
    tensors = checkpoint_tensors(random_model(MoEModelConfig.from_dict(raw), seed=1), fused=False)
    alias = {k.replace(old, new): v for k, v in tensors.items() if old in k}
    write_checkpoint(tmp_path, raw, {**tensors, **alias})
    with pytest.raises(CheckpointFormatError) as exc:
        MoECheckpoint(tmp_path)
    msg = str(exc.value)
    assert "non-canonical index" in msg and new in msg, msg


#: The parameter paths of a 3-layer model's experts and router (transformers 5 names them so).
_PARAMS = [f"model.layers.{i}.mlp.{p}" for i in range(3)
           for p in ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "gate.weight")]


def _peft_names(entry: str) -> set[str]:
    """Parameters peft 0.21.2 wraps for one target_parameters entry (BaseTuner._inject_parameters: the
    path equals the entry or ends with "." + entry), written out here."""
    return {p for p in _PARAMS if p == entry or p.endswith(f".{entry}")}


@pytest.mark.parametrize("entry", [
    "gate_up_proj", "down_proj", "experts.gate_up_proj", "mlp.experts.down_proj", "0.mlp.experts.gate_up_proj",
    "layers.1.mlp.experts.down_proj", "model.layers.2.mlp.experts.gate_up_proj",
    "gate.weight", "mlp.gate.weight", "gate_up_proj_bias", "experts", "mlp.experts", "p.experts.gate_up_proj",
    "block_sparse_moe.experts.down_proj", "layers.01.mlp.experts.down_proj", "xmodel.layers.0.mlp.experts.down_proj",
])
def test_target_parameter_entries_follow_peft(entry):
    wrapped = _peft_names(entry)
    expert = {p.rsplit(".", 1)[-1] for p in wrapped}
    served = expert_parameter(entry)
    if served is None:
        # peft wraps no expert parameter for it (another parameter, or nothing at all)
        assert not (expert & {"gate_up_proj", "down_proj"}), (entry, wrapped)
    else:
        assert wrapped and expert == {served}, (entry, wrapped, served)
    assert expert_parameter("block_sparse_moe.experts.down_proj", ("block_sparse_moe", "mlp")) == "down_proj"
