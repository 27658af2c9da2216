"""DeepSeek-V3 checkpoints and adapters (DESIGN.md §1; ``docs/checkpoints.md``): the readers, the
oracle and the reference backend against transformers' ``DeepseekV3ForCausalLM`` + peft on the
fixture ``deepseek_v3`` (4 groups of 2 experts, 2 kept; a nonzero correction bias; routed scaling
2.5; one dense first layer; two shared experts; MLA with q_lora_rank and YaRN), and the refusals.

- hf-check rows: the base model (routing, the MoE block with its ungated shared experts, the dense
  MLP of layer 0, every MLA projection), the peft adapters (routed experts + MLA projections, one
  under rsLoRA with a rank pattern) and the builder's shared-expert / dense-MLP adapter in PEFT's key
  format (peft 0.21.2 refuses to wrap those modules: compared with the per-module reference);
- hf-check's whole-model rows: the engine's prompt logprobs equal HF + PEFT, and a routing fault
  of the engine fails them;
- checkpoint-pass on the MoE layer with the reference backend in every layer mode;
- named refusals: expert or shared-expert keys on the dense layer, dense-MLP keys on the MoE layer,
  LoRA on MLA's norms, configs moelora does not serve, and (engine) a value head wider than the key head
  and TP / EP.
"""

import json
import shutil

import pytest
import torch

from moelora_conformance.checkpoint_pass.run import MODES, run_model
from moelora_conformance.fixtures.specs import DEEPSEEK_V3, DEEPSEEK_V3_ADAPTERS, MLA
from moelora_conformance.hf_check import check_adapter, check_layout_adapter, check_model_base, summarize
from moelora_core.checkpoint import (
    CheckpointFormatError,
    MissingTensorError,
    MoECheckpoint,
    UnmatchedKeysError,
    UnsupportedModelError,
    UnsupportedTargetError,
    read_adapter,
    read_model_config,
)
from moelora_core.checkpoint.synthetic import write_adapter

VISIBLE = 0.1
LAYOUT = "deepseek_v3-shared-dense"


def _failures(rows):
    return "\n".join(f"{r.source} L{r.layer} {r.part}: max_rel={r.max_rel:.3e} {r.note}" for r in rows if not r.ok)


def test_base_model_equals_hf(fixture_set):
    rows = check_model_base(fixture_set, DEEPSEEK_V3.name)
    assert all(r.ok for r in rows), _failures(rows)
    parts = {(r.layer, r.part) for r in rows}
    assert {(0, "mlp"), (0, "dense_gate"), (0, "dense_down"), (0, "q_a"), (0, "kv_b")} <= parts
    assert {(1, "routing"), (1, "moe"), (1, "shared_gate"), (1, "shared_down"), (1, "o")} <= parts
    assert (0, "routing") not in parts and (1, "dense_gate") not in parts  # no experts on the dense layer


@pytest.mark.parametrize("spec", DEEPSEEK_V3_ADAPTERS, ids=lambda s: s.name)
def test_peft_adapters_equal_hf_peft(fixture_set, spec):
    rows = check_adapter(fixture_set, spec.name)
    assert all(r.ok for r in rows), _failures(rows)
    assert {"hf-memory", "readers", "reference-backend"} <= {r.source for r in rows}
    seen = set()
    for r in rows:
        if r.source in ("hf-memory", "readers") and r.part in {"moe", *spec.dense}:
            assert r.delta_rel is not None and r.delta_rel > VISIBLE, (r.source, r.layer, r.part, r.delta_rel)
            seen.add(r.part)
    assert seen == {"moe", *spec.dense}
    assert set(spec.dense) <= set(MLA)


def test_shared_expert_and_dense_mlp_adapter_equals_the_per_module_reference(fixture_set):
    rows = check_layout_adapter(fixture_set, LAYOUT)
    assert all(r.ok for r in rows), _failures(rows)
    visible = {(r.layer, r.part) for r in rows if r.source == "per-module" and (r.delta_rel or 0) > VISIBLE}
    assert {(0, "mlp"), (0, "dense_gate"), (0, "dense_up"), (0, "dense_down"), (1, "moe"), (1, "shared_gate"),
            (1, "shared_up"), (1, "shared_down"), (0, "kv_b"), (1, "kv_b")} <= visible
    backend = {(r.layer, r.part) for r in rows if r.source == "reference-backend" and r.ok}
    assert {(0, "mlp"), (1, "moe"), (0, "mlp base rows"), (1, "moe base rows")} <= backend


def test_whole_model_logprobs_equal_hf_peft_and_a_routing_fault_fails_them(fixture_set):
    # hf-check's engine rows: prompt logprobs of the base model, a peft adapter and the builder's
    # shared-expert / dense-MLP adapter (per-module reference) within engine_vs_hf; the engine with
    # routed_scaling_factor on the shared experts too fails every row (base rows included)
    pytest.importorskip("moelora_runner")
    from moelora_conformance.faulty.routing_faults import make_engine_faulty
    from moelora_conformance.hf_check.model_logprobs import model_logprob_rows

    adapters = [DEEPSEEK_V3_ADAPTERS[0].name, LAYOUT]
    rows = model_logprob_rows(fixture_set, DEEPSEEK_V3.name, adapters)
    assert [r.adapter for r in rows] == ["(base)", *adapters]
    assert all(r.ok and r.part == "logprobs" and r.max_rel <= 1e-4 for r in rows), rows
    table = {s["adapter"]: s for s in summarize(rows)}  # hf-check's table: a note, not a relative error
    assert table["(base)"]["max_rel"] == 0.0 and "engine logprobs vs HF+PEFT" in table["(base)"]["notes"][0]
    faulty = model_logprob_rows(fixture_set, DEEPSEEK_V3.name, adapters,
                                prepare=lambda engine: make_engine_faulty(engine, "scaling-on-shared"))
    assert not any(r.ok for r in faulty), faulty
    assert "|Δlogprob|" in faulty[0].note


def test_checkpoint_pass_on_the_moe_layer(fixture_set, tmp_path):
    rows = run_model(fixture_set, tmp_path, DEEPSEEK_V3.name, backends=["reference"], num_requests=36)
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok][:3]
    assert {r.layer for r in rows} == {1}  # the dense layer has no MoE block for the harness
    assert {r.mode for r in rows} == set(MODES)
    hf_parts = {r.part for r in rows if r.check == "hf"}
    assert {"moe", "q_a", "q_b", "kv_a", "kv_b", "o", "shared_gate", "shared_up", "shared_down"} <= hf_parts


def _config(fixture_set, tmp_path, **over):
    raw = json.loads((fixture_set.model_dir(DEEPSEEK_V3.name) / "config.json").read_text())
    raw.update(over)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(("over", "error", "match"), [
    ({"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}}, UnsupportedModelError,
     "rope_type"),
    ({"n_group": 3}, CheckpointFormatError, "n_group"),
    ({"topk_group": 5}, CheckpointFormatError, "topk_group"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
])
def test_configs_moelora_does_not_serve_are_refused_by_name(fixture_set, tmp_path, over, error, match):
    with pytest.raises(error, match=match):
        read_model_config(_config(fixture_set, tmp_path, **over))


def test_a_checkpoint_without_the_correction_bias_is_refused(fixture_set, tmp_path):
    from safetensors.torch import load_file, save_file

    src = fixture_set.model_dir(DEEPSEEK_V3.name)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.mlp.gate.e_score_correction_bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="e_score_correction_bias"):
        MoECheckpoint(tmp_path)


def _adapter(tmp_path, keys: dict[str, tuple[int, int]], targets: list[str]):
    tensors = {}
    for key, (fin, fout) in keys.items():
        tensors[f"base_model.model.{key}.lora_A.weight"] = torch.randn(4, fin)
        tensors[f"base_model.model.{key}.lora_B.weight"] = torch.randn(fout, 4)
    return write_adapter(tmp_path / "adapter", tensors, {"r": 4, "lora_alpha": 8, "target_modules": targets})


@pytest.mark.parametrize(("key", "shape", "targets", "error", "match"), [
    ("model.layers.0.mlp.shared_experts.gate_proj", (40, 24), ["shared_experts.gate_proj"], UnmatchedKeysError,
     "match no module"),
    ("model.layers.1.mlp.gate_proj", (40, 36), ["mlp.gate_proj"], UnmatchedKeysError, "match no module"),
    ("model.layers.0.mlp.experts.0.gate_proj", (40, 12), ["gate_proj"], UnmatchedKeysError, "match no module"),
    ("model.layers.1.self_attn.kv_a_layernorm", (16, 16), ["kv_a_proj_with_mqa"], UnsupportedTargetError,
     "does not serve"),
])
def test_adapter_keys_that_name_no_served_module_are_refused(fixture_set, tmp_path, key, shape, targets, error,
                                                             match):
    cfg = read_model_config(fixture_set.model_dir(DEEPSEEK_V3.name))
    with pytest.raises(error, match=match):
        read_adapter(_adapter(tmp_path, {key: shape}, targets), cfg)


def test_the_engine_refuses_a_value_head_wider_than_the_key_head(fixture_set, tmp_path):
    # the engine's cache holds V zero-padded to the query/key width (moelora_runner.mla)
    from moelora_runner.model_info import ModelInfo

    with pytest.raises(UnsupportedModelError, match="v_head_dim"):
        ModelInfo.read(_config(fixture_set, tmp_path, v_head_dim=40))


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2), (2, 2)])
def test_the_engine_refuses_tp_and_ep_on_mla_by_name(fixture_set, tp, ep):
    # before it joins a process group: nothing of the family is sharded (ParallelLayout.check)
    pytest.importorskip("moelora_runner")
    from moelora_runner import Engine, EngineConfigError

    with pytest.raises(EngineConfigError, match=r"MLA attention \(DeepSeek-V3 / Kimi-K2\).*--tp 1 --ep 1"):
        Engine(fixture_set.model_dir(DEEPSEEK_V3.name), tp=tp, ep=ep)


def test_the_e2e_engine_adapters_target_mla_and_read_back(fixture_set, tmp_path):
    # ``moelora-conformance e2e --families deepseek_v3`` (opt-in, outside the CI-sized default)
    from moelora_conformance.e2e.adapters import build_engine_adapters, engine_adapter_dirs, engine_adapter_specs

    for _, fields in engine_adapter_specs(DEEPSEEK_V3.name):
        assert not set(fields["dense"]) & {"q", "k", "v"} and set(fields["dense"]) <= set(MLA)
        assert not any(k.endswith(("q_proj", "k_proj", "v_proj")) and "q_b" not in k
                       for k in {**fields["rank_pattern"], **fields["alpha_pattern"]})
    build_engine_adapters(tmp_path, [DEEPSEEK_V3.name])
    cfg = read_model_config(fixture_set.model_dir(DEEPSEEK_V3.name))
    for name, path in engine_adapter_dirs(tmp_path, [DEEPSEEK_V3.name])[DEEPSEEK_V3.name]:
        read = read_adapter(path, cfg, name=name)
        assert any(m in layer for layer in read.layers for m in ("q_a", "q_b", "kv_a", "kv_b", "o")), name
