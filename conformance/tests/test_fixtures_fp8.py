"""The fp8 block-scaled fixtures (DESIGN.md §1, "Quantized base"): quantized by moelora's builder from a
built fixture model and written as HF writes the format.

Covers: the manifest lists each fp8 model with ``quantized_from`` and its block; config.json holds
``quantization_config`` as HF writes it (routers and LM head in ``modules_to_not_convert``); the reader
serves it as ``fp8_block`` and its weights times their scales are within half an e4m3 step of the source
model's; the source model's adapters are the ones served on it (hf-check's list names existing ones);
hf-check's ``readers (w8a8)`` rows hold the oracle to transformers made w8a8 (``hf_check.hf_w8a8``, E02's
reference on an fp8 base), which refuses by name a checkpoint whose weights it cannot make w8a8.
"""

import json

import pytest
import torch

from moelora_conformance.fixtures.specs import FP8_MODELS, OPT_IN_FP8_MODELS
from moelora_core.checkpoint import MoECheckpoint
from moelora_reference.fp8_block import dequantize_moe


def test_manifest_and_config_describe_each_fp8_model(fixture_set):
    for spec in FP8_MODELS:
        entry = fixture_set.manifest["models"][spec.name]
        assert entry["quantized_from"] == spec.quantized_from
        assert entry["quantization"] == {"quant_method": "fp8", "weight_block_size": list(spec.block)}
        qc = json.loads((fixture_set.model_dir(spec.name) / "config.json").read_text())["quantization_config"]
        assert (qc["quant_method"], qc["weight_block_size"], qc["activation_scheme"]) == ("fp8", list(spec.block),
                                                                                          "dynamic")
        router = "model.layers.0.block_sparse_moe.gate" if spec.quantized_from == "mixtral" else "model.layers.0.mlp.gate"
        assert "lm_head" in qc["modules_to_not_convert"] and router in qc["modules_to_not_convert"]
        assert set(spec.adapters) <= set(fixture_set.manifest["adapters"])
        assert all(fixture_set.adapter(a)["model"] == spec.quantized_from for a in spec.adapters)


def test_fp8_weights_are_the_source_models_within_half_a_step(fixture_set):
    for spec in FP8_MODELS:
        with MoECheckpoint(fixture_set.model_dir(spec.name)) as fp8, \
                MoECheckpoint(fixture_set.model_dir(spec.quantized_from)) as src:
            assert fp8.config.base_quant == "fp8_block" and fp8.config.weight_block == spec.block
            for li in range(fp8.config.num_layers):
                ours, theirs = dequantize_moe(fp8.layer(li).moe), src.layer(li).moe
                for a, b in ((ours.w_gate_up, theirs.w_gate_up), (ours.w_down, theirs.w_down)):
                    err = (a - b.float()).abs()
                    assert bool((err <= 2.0 ** -4 * b.abs() + 1e-6).all())  # e4m3: 3 mantissa bits
                assert torch.equal(fp8.layer(li).moe.router, theirs.router)  # the router stays unquantized


def test_adapter_effect_probes_an_fp8_base_through_its_scales(fixture_set):
    # `hf-check --model <fp8 checkpoint> --adapter ...` once crashed here: the no-op probe multiplied the
    # fp8 codes themselves (torch has no fp8 matmul on the CPU). The probe reads the dequantized weight,
    # so an fp8 model and its source measure one adapter alike (within the quantization's few percent).
    from moelora_core.checkpoint import read_adapter
    from moelora_core.checkpoint.adapter_effect import adapter_effect

    for spec in FP8_MODELS:
        adapter = spec.adapters[0]
        with MoECheckpoint(fixture_set.model_dir(spec.name)) as fp8, \
                MoECheckpoint(fixture_set.model_dir(spec.quantized_from)) as src:
            read = read_adapter(fixture_set.adapter_dir(adapter), fp8.config, name=adapter)
            n = fp8.config.num_layers
            ours = adapter_effect(read, [fp8.layer(li) for li in range(n)], dtype=torch.float32)
            theirs = adapter_effect(read, [src.layer(li) for li in range(n)], dtype=torch.float32)
        assert not ours.noop and len(ours.modules) == len(theirs.modules)
        for a, b in zip(ours.modules, theirs.modules, strict=True):
            assert (a.layer, a.module) == (b.layer, b.module)
            assert a.delta_rel is not None and abs(a.delta_rel - b.delta_rel) <= 0.1 * b.delta_rel, (a, b)


def test_hf_check_w8a8_rows_hold_the_oracle_to_transformers_made_w8a8(fixture_set):
    # hf-check's "readers (w8a8)" rows: the oracle's w8a8 on the layer as read against transformers' dequantized
    # model with the fp8 activation rule (hf_check.hf_w8a8), base and an adapter, every part under the fp8 rows;
    # the deltas are a visible fraction of each block (a row that drops them fails); one model here, hf-check
    # itself runs every fp8 fixture
    from moelora_conformance.hf_check.run import check_adapter, check_model_base

    for fp8 in FP8_MODELS[:1]:
        rows = check_model_base(fixture_set, fp8.name) + check_adapter(fixture_set, fp8.adapters[0], model=fp8.name)
        w8a8 = [r for r in rows if r.source == "readers (w8a8)"]
        assert {r.part for r in w8a8} >= {"routing", "moe", "q", "o"} and all(r.ok for r in w8a8), \
            [r for r in w8a8 if not r.ok]
        assert {r.adapter for r in w8a8} == {"(base)", fp8.adapters[0]}
        assert all(r.delta_rel > 0.1 for r in w8a8 if r.adapter != "(base)" and r.part == "moe")


def test_the_w8a8_reference_refuses_a_checkpoint_it_cannot_make_w8a8(fixture_set, tmp_path):
    import shutil

    from moelora_conformance.hf_check.hf_model import load_hf
    from moelora_conformance.hf_check.hf_w8a8 import W8A8ReferenceError, make_w8a8

    with pytest.raises(W8A8ReferenceError, match="not an fp8 block-scaled checkpoint"):
        make_w8a8(torch.nn.Linear(2, 2), fixture_set.model_dir("qwen3_moe"))
    # a block size that disagrees with the scale grid: transformers' dequantized weights are not W_q · scale_inv
    bad = tmp_path / "bad"
    shutil.copytree(fixture_set.model_dir(FP8_MODELS[0].name), bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [32, 32]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(W8A8ReferenceError, match="is not W_q · scale_inv of its 32x32 blocks"):
        make_w8a8(load_hf(fixture_set.model_dir(FP8_MODELS[0].name)), bad)


@pytest.fixture(scope="module")
def with_qwen2_moe_fp8(fixture_set, tmp_path_factory):
    """The session's fixtures plus the opt-in ``qwen2_moe_fp8`` (built from its ``qwen2_moe``, about 1 s),
    in a directory of its own: the session's manifest stays the default set's."""
    from moelora_conformance.fixtures.build import fp8_model_entry
    from moelora_conformance.fixtures.fp8_models import save_fp8_model
    from moelora_conformance.fixtures.manifest import FixtureSet

    spec = next(m for m in OPT_IN_FP8_MODELS if m.name == "qwen2_moe_fp8")
    root = tmp_path_factory.mktemp("opt-in-fixtures")
    (root / "models").mkdir()
    for model in (fixture_set.root / "models").iterdir():
        (root / "models" / model.name).symlink_to(model)
    for sub in ("adapters", "layout_adapters", "bad_adapters"):
        (root / sub).symlink_to(fixture_set.root / sub)
    save_fp8_model(spec, fixture_set.model_dir(spec.quantized_from), root / "models" / spec.name)
    manifest = json.loads(json.dumps(fixture_set.manifest))
    manifest["models"][spec.name] = fp8_model_entry(spec, manifest["models"][spec.quantized_from])
    return spec, FixtureSet(root, manifest)


@pytest.mark.slow
def test_qwen2_moe_fp8_shared_expert_is_w8a8_in_the_oracle_and_in_transformers_made_w8a8(with_qwen2_moe_fp8,
                                                                                       monkeypatch):
    # the opt-in fixture stores Qwen2-MoE's shared expert fp8 (its sigmoid gate and the routers not): hf-check's
    # "readers (w8a8)" rows hold the oracle's MoE block — routed experts plus the shared expert, each fp8
    # projection w8a8, the shared-expert LoRA on the unquantized inputs — and each shared projection to
    # transformers made w8a8; an oracle whose shared expert is w8a16 (dequantized weights, x as given) fails
    # the MoE rows
    from moelora_conformance.hf_check import compare
    from moelora_conformance.hf_check.run import check_adapter, check_model_base

    spec, fixtures = with_qwen2_moe_fp8
    with MoECheckpoint(fixtures.model_dir(spec.name)) as ckpt:
        layer = ckpt.layer(0)
        assert {"shared_gate", "shared_up", "shared_down"} <= set(layer.dense_scales)
        assert layer.shared_expert.gate_proj.dtype == torch.float8_e4m3fn
        assert layer.shared_expert.gate.dtype != torch.float8_e4m3fn  # mlp.shared_expert_gate: not converted
    rows = check_model_base(fixtures, spec.name) + check_adapter(fixtures, "qwen2_moe-r8", model=spec.name)
    w8a8 = [r for r in rows if r.source == "readers (w8a8)"]
    assert {r.part for r in w8a8} >= {"moe", "shared_gate", "shared_up", "shared_down"}
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert all(r.delta_rel > 0.1 for r in w8a8 if r.adapter != "(base)" and r.part.startswith("shared_"))

    w8a8_oracle = compare.shared_expert_forward

    def w8a16(x, shared, lora, mapping, *, weight_block=None, weight_scales=None):
        from dataclasses import replace

        from moelora_reference.fp8_block import dequantize_weight

        names = dict(zip(shared.modules, ("gate_proj", "up_proj", "down_proj"), strict=True))
        deq = {names[m]: dequantize_weight(shared.dense(m), s, weight_block) for m, s in (weight_scales or {}).items()}
        return w8a8_oracle(x, replace(shared, **deq), lora, mapping)

    monkeypatch.setattr(compare, "shared_expert_forward", w8a16)
    bad = [r for r in check_model_base(fixtures, spec.name) if r.source == "readers (w8a8)" and not r.ok]
    assert {r.part for r in bad} == {"moe"}, bad
