"""The real-checkpoint pass (``moelora_conformance.checkpoint_pass``, ``moelora-conformance checkpoint-pass``).

Covers: every fixture model gets at least three adapters of different ranks, one rsLoRA and one
legacy per-expert, read back from disk with the rank and σ their configs say; the batches hold
more than 32 requests of more than one token, every adapter slot and base requests; the pass on
the H = 2·I model through the reference backend in every layer mode compares every adapter and the
base rows against HF + PEFT; the Qwen2-MoE shared expert's projections pass through the dense path
against the PEFT-wrapped ``mlp.shared_expert`` (the kernel backends on both models: the main job,
``nox -s conformance``)
(Qwen2-MoE gets no legacy adapter: peft 0.21.2 does not convert them, a named test); a faulty backend (σ = α/r
for rsLoRA) fails it on the rsLoRA adapter's rows and the command exits 1; the command refuses a
backend it cannot load (exit 2) and registers through the CLI's subcommand registry.
"""

import importlib.util
import json
import math

import pytest

from moelora_conformance import cli
from moelora_conformance.checkpoint_pass.adapters import PEFT_UNCONVERTED_LEGACY, build_pass_adapters
from moelora_conformance.checkpoint_pass.batches import decode_batch, extend_batch
from moelora_conformance.checkpoint_pass.run import MODES, run_checkpoint_pass, run_model
from moelora_conformance.fixtures.specs import MODELS, POOL_MAX_RANK, SHARED, model_spec
from moelora_core import NO_ADAPTER, ForwardMode
from moelora_core.checkpoint import MoECheckpoint, read_adapter

KERNEL_BACKENDS = ("triton", "csgmv") if importlib.util.find_spec("moelora_backends") else ()


def test_the_subcommand_is_registered():
    assert "checkpoint-pass" in cli.SUBCOMMANDS


@pytest.mark.parametrize("model", [m.name for m in MODELS])
def test_every_model_gets_three_ranks_with_rslora_and_legacy(fixture_set, tmp_path, model):
    adapters = build_pass_adapters(fixture_set, tmp_path, model)
    ours = [a for a in adapters if a.origin == "pass"]
    legacy = model_spec(model).family not in PEFT_UNCONVERTED_LEGACY
    assert len({a.r for a in ours}) == (3 if legacy else 2)
    assert any(a.use_rslora for a in ours) and any(a.format == "per_expert" for a in ours) == legacy
    with MoECheckpoint(fixture_set.model_dir(model)) as ckpt:
        for a in ours:
            read = read_adapter(a.path, ckpt.config, name=a.name, max_rank=POOL_MAX_RANK)
            for layer in read.layers:
                for module, lora in layer.items():
                    alpha = 2 * a.r  # the pass's adapters all have α = 2r
                    sigma = alpha / math.sqrt(a.r) if a.use_rslora else alpha / a.r
                    assert lora.rank == a.r and math.isclose(lora.scaling, sigma, rel_tol=1e-12), (a.name, module)


def test_batches_mix_every_slot_and_base_past_32_requests():
    ranks, scalings = (8, 6, 3), (2.0, 4.9, 2.0)
    ext = extend_batch(ranks, scalings, num_adapters=3, seed=5)
    dec = decode_batch(ranks, scalings, num_adapters=3, seed=5)
    for batch in (ext, dec):
        assert batch.bs > 32 and min(batch.seq_lens) >= 2
        assert set(batch.req_weight_indices) == {NO_ADAPTER, 0, 1, 2}
    assert ext.forward_mode is ForwardMode.EXTEND and len(set(ext.seq_lens)) > 1
    assert dec.forward_mode is ForwardMode.DECODE and dec.tokens_per_request == 2


def test_the_h2i_model_passes_in_every_mode_with_every_adapter(fixture_set, tmp_path):
    backends = ("reference",)
    rows = run_model(fixture_set, tmp_path, "qwen3_moe_h2i", backends=backends, layers=[0])
    bad = [r for r in rows if not r.ok]
    assert not bad, bad[:5]
    adapters = {a.name for a in build_pass_adapters(fixture_set, tmp_path, "qwen3_moe_h2i")}
    for backend in backends:
        for mode in MODES:
            cell = [r for r in rows if r.backend == backend and r.mode == mode]
            assert any(r.check == "oracle" for r in cell), (backend, mode)
            assert {r.subject for r in cell if r.check == "hf"} == adapters | {"(base)"}, (backend, mode)
            assert {r.part for r in cell if r.check == "hf"} == {"moe", "q", "k", "v", "o"}


def test_the_qwen2_moe_shared_expert_passes_in_every_mode(fixture_set, tmp_path):
    # The shared expert's gate / up / down run as dense modules of the layer, through the backend's dense
    # path, against the PEFT-wrapped mlp.shared_expert projections (the kernel backends' dense paths,
    # segmented for triton and chunked SGMV for csgmv, on this model: the main job's checkpoint pass).
    rows = run_model(fixture_set, tmp_path, "qwen2_moe", backends=["reference"], layers=[0])
    bad = [r for r in rows if not r.ok]
    assert not bad, bad[:5]
    cells = [("reference", mode) for mode in MODES]
    for backend, mode in cells:
        parts = {r.part for r in rows if r.backend == backend and r.mode == mode and r.check == "hf"}
        assert parts == {"moe", "q", "k", "v", "o", *SHARED}, (backend, mode)
    shared_adapters = {r.subject for r in rows if r.check == "hf" and r.part == "shared_down"}
    assert {"qwen2_moe-pass-r8", "qwen2_moe-pass-rslora-r6", "qwen2_moe-shared-only"} <= shared_adapters


def test_shared_expert_layout_adapters_pass_against_the_per_module_reference(fixture_set, tmp_path):
    # The four shared-outer / fully shared fixture adapters (3-D and 2-D encodings) with one
    # per-expert pass adapter in one pool (their shared factors broadcast), the reference backend in
    # every mode, each adapter's rows against the per-module reference of its own tensors.
    from moelora_conformance.checkpoint_pass.adapters import layout_pass_adapters

    layout = layout_pass_adapters(fixture_set, "qwen3_moe")
    assert len(layout) == 4
    one = [a for a in build_pass_adapters(fixture_set, tmp_path, "qwen3_moe") if a.origin == "pass"][:1]
    rows = run_model(fixture_set, tmp_path, "qwen3_moe", backends=["reference"], layers=[0], num_requests=36,
                     adapters=one + layout)
    bad = [r for r in rows if not r.ok]
    assert not bad, bad[:5]
    for mode in MODES:
        subjects = {r.subject for r in rows if r.mode == mode and r.check == "hf" and r.part == "moe"}
        assert {a.name for a in layout} <= subjects, (mode, subjects)


def test_peft_does_not_convert_legacy_qwen2_moe_adapters():
    # Why the pass (and the engine tests) give Qwen2-MoE no legacy per-expert adapter: peft 0.21.2
    # converts legacy adapters only for the model types its table maps to qwen2_moe, not for qwen2_moe
    # itself, and then drops the per-expert keys. When this fails, peft serves them: drop qwen2_moe
    # from PEFT_UNCONVERTED_LEGACY (and the engine tests' replacement adapter).
    from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN

    assert _MODEL_TO_CONVERSION_PATTERN.get("qwen3_moe") == "qwen2_moe"
    assert "qwen2_moe" not in _MODEL_TO_CONVERSION_PATTERN
    assert PEFT_UNCONVERTED_LEGACY == {"qwen2_moe"}


def test_a_faulty_backend_fails_the_pass(fixture_set, tmp_path, capsys):
    bad = "moelora_conformance.faulty:make_alpha_over_r"  # σ = α/r where rsLoRA asks α/√r
    rows = run_model(fixture_set, tmp_path, "qwen3_moe_h2i", backends=[bad], modes=["eager"], layers=[0])
    failed = {(r.check, r.subject) for r in rows if not r.ok}
    assert ("oracle", "all rows") in failed
    assert ("hf", "qwen3_moe_h2i-pass-rslora-r6") in failed and ("hf", "(base)") not in failed
    status = cli.main(["checkpoint-pass", "--fixtures", str(fixture_set.root), "--work-dir", str(tmp_path),
                       "--backends", bad, "--models", "qwen3_moe_h2i", "--modes", "eager", "--layers", "0",
                       "--json", str(tmp_path / "rows.json")])
    assert status == 1
    assert "FAIL" in capsys.readouterr().out
    written = json.loads((tmp_path / "rows.json").read_text())
    assert any(not r["ok"] for r in written) and {r["backend"] for r in written} == {bad}


def test_an_unknown_backend_is_a_usage_error(fixture_set, tmp_path, capsys):
    status = cli.main(["checkpoint-pass", "--fixtures", str(fixture_set.root), "--work-dir", str(tmp_path),
                       "--backends", "no_such_module:make_backend"])
    assert status == 2
    assert "cannot import" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["reference", *KERNEL_BACKENDS[:1]])
def test_the_pass_on_gpt_oss_equals_hf_peft(fixture_set, tmp_path, backend):
    # GPT-OSS: interleaved gate/up read, expert and router biases and swiglu_oai in the harness's base
    # path and expected values, routing by the layer's own mlp.router; two pass adapters (no legacy form)
    # plus the fixture's two. The kernel backend runs eager only (the interpreter is slow).
    modes = MODES if backend == "reference" else ["eager"]
    rows = run_model(fixture_set, tmp_path, "gpt_oss", backends=[backend], modes=modes, layers=[0])
    bad = [r for r in rows if not r.ok]
    assert not bad, [(r.mode, r.subject, r.part, r.note) for r in bad[:5]]
    hf = {(r.subject, r.part) for r in rows if r.check == "hf"}
    assert {("gpt_oss-pass-r8", "moe"), ("gpt_oss-pass-rslora-r6", "moe"), ("gpt_oss-r8", "o"), ("(base)", "moe")} <= hf
    assert {r.mode for r in rows} == set(modes)


def test_the_fp8_model_passes_w8a8_and_a_backend_not_declaring_it_is_refused(fixture_set, tmp_path):
    # DESIGN.md §1 "Quantized base": the reference runs the w8a8 experts against the oracle's w8a8; csgmv,
    # which does not declare base_quant=fp8_block, gets one start-up row and no run
    rows = run_model(fixture_set, tmp_path, "qwen3_moe_fp8", backends=("reference", "csgmv"), modes=("eager",),
                     layers=[0])
    assert not [r for r in rows if not r.ok], [r for r in rows if not r.ok][:5]
    ref = [r for r in rows if r.backend == "reference"]
    assert any(r.check == "oracle" for r in ref)
    assert {r.part for r in ref if r.check == "hf"} == {"q", "k", "v", "o"}  # HF computes w8a16 experts
    refused = [r for r in rows if r.backend == "csgmv"]
    assert [r.check for r in refused] == ["declared"] and "UnsupportedBaseQuantError" in refused[0].note


def test_skip_models_leaves_them_out_and_an_unknown_one_is_a_usage_error(fixture_set, tmp_path, capsys):
    # the main job leaves fp8 copies out this way (noxfile.py MAIN_CHECKS)
    rows = run_checkpoint_pass(fixture_set, tmp_path, models=["qwen3_moe_h2i", "qwen3_moe_fp8"],
                               skip_models=["qwen3_moe_fp8"], backends=["reference"], modes=["eager"], layers=[0])
    assert rows and {r.model for r in rows} == {"qwen3_moe_h2i"}
    status = cli.main(["checkpoint-pass", "--fixtures", str(fixture_set.root), "--work-dir", str(tmp_path / "w"),
                       "--backends", "reference", "--skip-models", "qwen3_moe_fp8,no_such_model"])
    assert status == 2
    assert "no_such_model" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before any run
