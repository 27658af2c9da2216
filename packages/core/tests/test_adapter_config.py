"""AdapterConfig: σ = α/r or α/√r (rsLoRA), rank_pattern / alpha_pattern with PEFT's matching."""

import math

import pytest

from moelora_core import AdapterConfig, InvalidFieldError, lora_scaling


def test_plain_and_rslora_scaling():
    assert lora_scaling(8, 16, False) == 2.0
    assert math.isclose(lora_scaling(16, 8, True), 2.0)  # 8/√16
    assert lora_scaling(16, 8, True) != lora_scaling(16, 8, False)  # rsLoRA must change σ


def test_patterns_match_path_suffix_first_key_wins():
    cfg = AdapterConfig(
        r=8, lora_alpha=16,
        rank_pattern={"layers.1.mlp.experts": 4, "experts": 2},
        alpha_pattern={"q_proj": 3.0},
    )
    assert cfg.rank_for("model.layers.1.mlp.experts") == 4
    assert cfg.rank_for("model.layers.0.mlp.experts") == 2
    assert cfg.rank_for("model.layers.0.self_attn.q_proj") == 8
    # suffix must sit on a dot boundary: "xq_proj" is not "q_proj"
    assert cfg.alpha_for("model.layers.0.self_attn.xq_proj") == 16.0
    assert cfg.alpha_for("model.layers.0.self_attn.q_proj") == 3.0
    assert cfg.scaling_for("model.layers.0.self_attn.q_proj") == 3.0 / 8
    assert cfg.scaling_for("model.layers.1.mlp.experts") == 16 / 4


def test_rslora_uses_module_rank():
    cfg = AdapterConfig(r=16, lora_alpha=8, use_rslora=True, rank_pattern={"down_proj": 4})
    assert math.isclose(cfg.scaling_for("m.layers.0.mlp.down_proj"), 8 / 2)
    assert math.isclose(cfg.scaling_for("m.layers.0.mlp.up_proj"), 8 / 4)
    assert math.isclose(cfg.scaling_for("m.layers.0.mlp.up_proj", rank=9), 8 / 3)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"r": 0, "lora_alpha": 1}, "rank"),
        ({"r": 4, "lora_alpha": float("inf")}, "lora_alpha"),
        ({"r": 4, "lora_alpha": 1, "rank_pattern": {"(": 2}}, "rank_pattern['(']"),
        ({"r": 4, "lora_alpha": 1, "rank_pattern": {"q": 0}}, "rank"),
        ({"r": 4, "lora_alpha": 1, "alpha_pattern": {"q": float("nan")}}, "alpha_pattern['q']"),
    ],
)
def test_invalid_config(kw, field):
    with pytest.raises(InvalidFieldError) as exc:
        AdapterConfig(**kw)
    assert exc.value.field == field


def test_patterns_frozen():
    src = {"q": 2}
    cfg = AdapterConfig(r=4, lora_alpha=4, rank_pattern=src)
    src["k"] = 3
    assert "k" not in cfg.rank_pattern
    with pytest.raises(TypeError):
        cfg.rank_pattern["v"] = 1
