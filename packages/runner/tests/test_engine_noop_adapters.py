"""No-op adapters in the engine and the ``moelora`` command: served, and named at load.

Covers: peft's default-init adapter (``init_lora_weights=True``: every lora_B zero) loads with an
``AdapterWarning`` naming it a no-op, is served (its requests equal base requests), and
``Engine.adapter_effect`` says so; a trained adapter loads without a warning and its modules' probe
deltas are visible; ``load_adapter_from_tensors`` warns alike; ``moelora generate`` exits 0 and prints
the warning on stderr.
"""

from __future__ import annotations

import json
import warnings

import pytest

from moelora_core.checkpoint import AdapterWarning

MODEL = "qwen3_moe"


@pytest.fixture(scope="module")
def default_init_adapter(tmp_path_factory, fixture_set):
    """peft's adapter with its default init (lora_B = 0) on the qwen3_moe fixture, as users save it."""
    from peft import LoraConfig, get_peft_model

    from moelora_conformance.hf_check.hf_model import load_hf

    directory = tmp_path_factory.mktemp("noop") / "default-init"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(load_hf(fixture_set.model_dir(MODEL)),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj",
                                                                             "down_proj"]))
    model.save_pretrained(str(directory))
    return directory


def _req(adapter, rid):
    return dict(request_id=rid, prompt_token_ids=[5, 17, 42, 8, 3], adapter=adapter, max_new_tokens=3,
                ignore_eos=True, prompt_logprobs=True)


def test_default_init_adapter_is_served_with_a_warning(make_engine, default_init_adapter, fixture_set):
    engine = make_engine(MODEL, adapters=False)
    with pytest.warns(AdapterWarning, match=r"adapter 'noop' is a no-op: lora_B is exactly zero \(8 of 8 modules\)"):
        engine.load_adapter("noop", default_init_adapter)
    assert engine.adapter_effect("noop").noop
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterWarning)  # a trained adapter: no warning
        engine.load_adapter("r8", fixture_set.adapter_dir(f"{MODEL}-r8"))
    effect = engine.adapter_effect("r8")
    assert not effect.noop and effect.probed and all(m.delta_rel > 1e-2 for m in effect.modules)
    noop, base = engine.generate([_req("noop", "a"), _req(None, "b")])
    assert noop.finish_reason == "length" and noop.output_token_ids == base.output_token_ids
    assert noop.prompt_logprobs == base.prompt_logprobs and noop.output_logprobs == base.output_logprobs


def test_in_memory_default_init_adapter_warns(make_engine, default_init_adapter):
    from safetensors.torch import load_file

    engine = make_engine(MODEL, adapters=False)
    config = json.loads((default_init_adapter / "adapter_config.json").read_text())
    tensors = load_file(str(default_init_adapter / "adapter_model.safetensors"))
    with pytest.warns(AdapterWarning, match="is a no-op"):
        engine.load_adapter_from_tensors("rl", tensors, config)


def test_generate_names_the_noop_adapter_and_exits_0(tmp_path, fixture_set, default_init_adapter, capsys):
    from moelora_runner.cli import main

    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(_req("noop", "a")) + "\n")
    rc = main(["generate", "--model", str(fixture_set.model_dir(MODEL)), "--adapter", f"noop={default_init_adapter}",
               "--requests", str(requests), "--output", str(tmp_path / "out.jsonl"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "moelora: warning: adapter 'noop' is a no-op: lora_B is exactly zero" in " ".join(err.split())
    assert json.loads((tmp_path / "out.jsonl").read_text())["finish_reason"] == "length"
