"""The one documented divergence from peft (DESIGN.md §1): a legacy per-expert adapter under rsLoRA.

The file holds per-expert gate_proj / up_proj / down_proj modules of rank r and α, so σ = α/√r for
each (moelora follows the file's own modules). peft 0.21.2 converts such an adapter on load into
one fused gate_up module of rank 2r and α 2α (``peft/utils/transformers_weight_conversion.py``),
whose rsLoRA σ is 2α/√(2r) = √2·α/√r: its gate and up deltas are √2 times the file's. Down keeps
rank r and α, so it agrees. This test pins all of that down:

1. the readers give gate/up/down σ = α/√r, while peft's in-memory gate_up layer has rank 2r, σ √2·α/√r;
2. the readers' oracle equals the per-module reference (each module's own delta merged into
   transformers' weights) — that is the answer moelora serves;
3. HF+PEFT differs from it on the MoE block by far more than the tolerance, and equals the
   readers' oracle once gate/up σ is multiplied by √2: the divergence is exactly peft's σ.
"""

import math

from moelora_conformance.hf_check import check_adapter, hf_model

NAME = "qwen3_moe-legacy-rslora"


def test_peft_scales_gate_up_by_sqrt2_and_moelora_does_not(fixture_set):
    from moelora_core.checkpoint import read_adapter, read_model_config

    entry = fixture_set.adapter(NAME)
    assert entry["peft_divergent"] and entry["use_rslora"] and entry["format"] == "per_expert"
    r, alpha = entry["r"], entry["lora_alpha"]
    cfg = read_model_config(fixture_set.model_dir(entry["model"]))
    read = read_adapter(fixture_set.adapter_dir(NAME), cfg)
    for layer in read.layers:
        for m in ("gate", "up", "down"):
            assert layer[m].rank == r and math.isclose(layer[m].scaling, alpha / math.sqrt(r))

    peft = hf_model.load_hf(fixture_set.model_dir(entry["model"]), fixture_set.adapter_dir(NAME))
    experts = hf_model.decoder_layers(peft)[0].mlp.experts  # outer ParamWrapper: down
    gate_up = experts.base_layer
    assert (experts.parameter_name, gate_up.parameter_name) == ("down_proj", "gate_up_proj")
    assert experts.r["default"] == r and math.isclose(experts.scaling["default"], alpha / math.sqrt(r))
    assert gate_up.r["default"] == 2 * r
    assert math.isclose(gate_up.scaling["default"], 2 * alpha / math.sqrt(2 * r))
    assert math.isclose(gate_up.scaling["default"], math.sqrt(2) * alpha / math.sqrt(r))


def test_readers_follow_the_file_and_peft_diverges_by_exactly_its_sigma(fixture_set):
    rows = check_adapter(fixture_set, NAME)
    assert all(r.ok for r in rows), [(r.source, r.layer, r.part, r.note) for r in rows if not r.ok]
    moe = {(r.source, r.layer): r for r in rows if r.part == "moe"}
    for layer in (0, 1):
        assert moe[("per-module", layer)].expect == "equal" and moe[("per-module", layer)].max_rel <= 1e-5
        diverge = moe[("readers", layer)]
        assert diverge.expect == "diverge" and diverge.max_rel > 1e-2  # peft's answer is not the file's
        assert moe[("readers σ·√2", layer)].max_rel <= 1e-5  # ... and differs by exactly peft's σ
        assert moe[("hf-memory", layer)].max_rel <= 1e-5  # the oracle does what peft's modules say
    # Attention and routing are untouched by the conversion: equal on every path.
    assert all(r.max_rel <= 1e-5 for r in rows if r.part in ("routing", "q", "k", "v", "o"))
