"""Adapter files as users make them: every form peft 0.21.2 writes for every fixture family is served
and means what HF + PEFT applies, or is refused naming the rule it breaks (``docs/checkpoints.md``,
"Adapter files peft writes").

The files are made here, with peft, from the ``LoraConfig`` target specs users write
(:data:`SPECS`): ``target_modules`` with the transformers-v4 expert names (peft 0.21.2 converts
``gate_proj`` / ``up_proj`` / ``down_proj`` — Mixtral ``w1`` / ``w3`` / ``w2`` — into the fused
experts' ``target_parameters`` and writes the short names ``gate_up_proj`` / ``down_proj`` with a
``.*\\.gate_up_proj`` rank / alpha pattern of 2r / 2α), ``"all-linear"``, attention only,
``target_parameters`` short, partial (``experts.``), full (``mlp.experts.``) and per layer, and
``rank_pattern`` / ``alpha_pattern`` keyed by short or full names. For each family × spec:

- peft refuses the config (``gate_proj`` without ``up_proj``; only expert names the family lacks):
  there is no file; the case must be one of :data:`PEFT_REFUSES` (a peft that starts accepting one
  fails here, so its file gets checked);
- otherwise peft wrote a file and loads it (``PeftModel.from_pretrained``); moelora's reader either
  serves it — and then every layer's MoE block (Qwen2-MoE: with the gated shared expert) and dense
  projections, the oracle on the readers' pool, equal the loaded peft model (fp32 tolerance), and
  every LoRA delta is visible — or refuses it with one of the rules of :data:`NOT_SERVED`, the
  message naming the rule. A refusal for any other reason fails: peft applies the file.

The issue's repro — a Qwen3-MoE adapter made with ``target_modules=["q_proj", "gate_proj",
"up_proj", "down_proj"]`` — also runs through ``moelora generate`` and must match HF + PEFT
(``test_naive_qwen3_adapter_is_served_by_moelora_generate``).
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from moelora_conformance.fixtures.specs import GPT_OSS, MODELS

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")
_SPECS = {m.name: m for m in (*MODELS, GPT_OSS)}
_NAIVE = ["q_proj", "gate_proj", "up_proj", "down_proj"]

#: The target specs users write (LoraConfig keyword arguments on top of r=8, lora_alpha=16).
SPECS: dict[str, dict] = {
    "naive": dict(target_modules=_NAIVE),
    "naive-rslora": dict(target_modules=_NAIVE, use_rslora=True),
    "naive-patterns": dict(target_modules=_NAIVE, rank_pattern={"down_proj": 4}, alpha_pattern={"q_proj": 5}),
    "mlp-only": dict(target_modules=["gate_proj", "up_proj", "down_proj"]),
    "gate-up-only": dict(target_modules=["gate_proj", "up_proj"]),
    "down-only": dict(target_modules=["down_proj"]),
    "gate-only": dict(target_modules=["gate_proj"]),
    "mixtral-names": dict(target_modules=["q_proj", "w1", "w2", "w3"]),
    "attention": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "attention-paths": dict(target_modules=["self_attn.q_proj", "self_attn.o_proj"]),
    "all-linear": dict(target_modules="all-linear"),
    "params-short": dict(target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"]),
    "params-experts": dict(target_modules=None, target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
    "params-full": dict(target_modules=["v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "params-layer0": dict(target_modules=["q_proj"],
                          target_parameters=["model.layers.0.mlp.experts.gate_up_proj", "down_proj"]),
    "patterns-short": dict(target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"],
                           rank_pattern={"down_proj": 4}, alpha_pattern={"gate_up_proj": 3}),
    "patterns-full": dict(target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"],
                          rank_pattern={"mlp.experts.down_proj": 4}, alpha_pattern={"mlp.experts.gate_up_proj": 3},
                          use_rslora=True),
}

#: What moelora does not serve by design although peft applies it (DESIGN.md §1 has no router delta and
#: no LoRA on Qwen2-MoE's sigmoid gate): (family, spec) → (refusal class, fragment naming the rule).
NOT_SERVED: dict[tuple[str, str], tuple[str, str]] = {
    **{(f, "all-linear"): ("UnsupportedTargetError", "LoRA on the router is not served")
       for f in ("qwen3_moe", "mixtral", "olmoe")},
    ("qwen2_moe", "all-linear"): ("UnsupportedTargetError", "LoRA on the shared expert's sigmoid gate"),
}
#: (family, spec) whose LoraConfig peft 0.21.2 itself refuses (no file exists).
PEFT_REFUSES: frozenset[tuple[str, str]] = frozenset({
    ("qwen3_moe", "gate-only"), ("olmoe", "gate-only"),  # gate_proj is fused with up_proj: both or neither
    # transformers 5's Mixtral and GPT-OSS have no gate_proj / up_proj / down_proj module to wrap
    *((f, s) for f in ("mixtral", "gpt_oss") for s in ("mlp-only", "gate-up-only", "down-only", "gate-only")),
})
#: Every delta of a served module is at least this fraction of its output (a dropped, doubled or
#: transposed delta then fails by far more than the fp32 tolerance).
VISIBLE = 1e-2


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family → (model dir, the transformers base model read back from it, MoECheckpoint config and layers)."""
    from moelora_conformance.fixtures.models import save_model
    from moelora_conformance.hf_check.hf_model import load_hf
    from moelora_core.checkpoint import MoECheckpoint

    root = tmp_path_factory.mktemp("peft-formats")
    out = {}
    for family in FAMILIES:
        directory = root / family
        save_model(_SPECS[family], directory)
        with MoECheckpoint(directory) as ckpt:
            layers = [ckpt.layer(i) for i in range(ckpt.config.num_layers)]
            out[family] = (directory, load_hf(directory), ckpt.config, layers)
    return out


def _write(base, directory: Path, spec: dict) -> str | None:
    """peft's adapter of ``spec`` on ``base`` saved to ``directory`` (its factors random: init off), or
    peft's refusal as text."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        try:
            model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                                   **spec))
        except Exception as exc:  # peft's own refusal of the config: no file to serve
            return f"{type(exc).__name__}: {exc}"
        model.save_pretrained(str(directory))
    return None


def _load_peft(base, directory: Path):
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(copy.deepcopy(base), str(directory)).eval()


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_written_adapter_is_served_or_refused_by_rule(families, tmp_path, family, spec):
    from moelora_conformance.hf_check.compare import SLOT, compare_layer
    from moelora_conformance.hf_check.hf_model import decoder_layers, hf_dense, hf_moe, hf_route
    from moelora_core import LoRAWeights
    from moelora_core.checkpoint import AdapterRefusal, load_adapter_into_slot, read_adapter

    _, base, cfg, disk = families[family]
    peft_refusal = _write(base, tmp_path / spec, SPECS[spec])
    if peft_refusal is not None:
        assert (family, spec) in PEFT_REFUSES, f"peft refuses this config: {peft_refusal}"
        return
    assert (family, spec) not in PEFT_REFUSES, "peft now writes a file for this config"
    written = json.loads((tmp_path / spec / "adapter_config.json").read_text())
    peft_model = _load_peft(base, tmp_path / spec)
    try:
        read = read_adapter(tmp_path / spec, cfg, name=spec)
    except AdapterRefusal as exc:
        assert (family, spec) in NOT_SERVED, (
            f"peft applies this file but moelora refuses it: {type(exc).__name__}: {exc}\n"
            f"adapter_config.json: target_modules={written.get('target_modules')} "
            f"target_parameters={written.get('target_parameters')} rank_pattern={written.get('rank_pattern')}")
        cls, fragment = NOT_SERVED[(family, spec)]
        assert type(exc).__name__ == cls and fragment in str(exc), str(exc)
        return
    assert (family, spec) not in NOT_SERVED, f"served, but expected a refusal: {NOT_SERVED[(family, spec)]}"
    pools = [LoRAWeights(cfg.layer_spec(max_loras=SLOT + 1, max_rank=max(16, read.max_rank())))
             for _ in range(cfg.num_layers)]
    load_adapter_into_slot(pools, SLOT, read)
    rows = []
    for li, layer in enumerate(decoder_layers(peft_model)):
        d = disk[li]
        rows += compare_layer(model=family, adapter=spec, source="readers", layer=li, moe=d.moe,
                              dense={m: d.dense(m) for m in cfg.dense_shapes}, pool=pools[li], top_k=cfg.top_k,
                              seed=li, shared=d.shared_expert,
                              dense_bias={m: b for m in "qkvo" if (b := d.bias(m)) is not None},
                              hf_moe=lambda x, la=layer: hf_moe(la, x), hf_route=lambda x, la=layer: hf_route(la, x),
                              hf_dense=lambda m, x, la=layer: hf_dense(la, m, x))
    bad = [f"L{r.layer} {r.part}: {r.note}" for r in rows if not r.ok]
    assert not bad, "\n".join(bad[:6])
    # every module the file holds changes its output visibly (a silently dropped target fails here)
    served = {(r.layer, r.part) for r in rows if r.delta_rel is not None and r.delta_rel > VISIBLE}
    for li, modules in enumerate(read.layers):
        want = {"moe" if m in ("gate", "up", "down", "shared_gate", "shared_up", "shared_down") else m
                for m in modules}
        assert {(li, p) for p in want} <= served, (li, sorted(modules), sorted(served))
    assert any(read.layers), "an adapter with no module"


def test_naive_qwen3_config_is_what_peft_writes(families, tmp_path):
    # the form the issue reports: short target_parameters names and the gate_up rank/alpha pattern
    _, base, _, _ = families["qwen3_moe"]
    assert _write(base, tmp_path / "naive", SPECS["naive"]) is None
    written = json.loads((tmp_path / "naive" / "adapter_config.json").read_text())
    assert sorted(written["target_parameters"]) == ["down_proj", "gate_up_proj"]
    assert written["target_modules"] == ["q_proj"]
    assert written["rank_pattern"] == {r".*\.gate_up_proj": 16}


def test_naive_qwen3_adapter_is_served_by_moelora_generate(families, tmp_path, capsys):
    # The repro end to end: the CLI serves peft's naive file and every request equals HF + PEFT.
    from moelora_conformance.e2e.engine_checks import HFReference, check_against_hf
    from moelora_runner.cli import main

    model_dir, base, _, _ = families["qwen3_moe"]
    assert _write(base, tmp_path / "naive", SPECS["naive"]) is None
    gen = torch.Generator().manual_seed(3)
    requests = [dict(request_id=f"r{i}", prompt_token_ids=torch.randint(2, 90, (n,), generator=gen).tolist(),
                     adapter="naive" if i % 3 else None, max_new_tokens=4, ignore_eos=True, prompt_logprobs=True,
                     logprobs=2) for i, n in enumerate((1, 5, 9, 3, 12, 7))]
    (tmp_path / "req.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    rc = main(["generate", "--model", str(model_dir), "--adapter", f"naive={tmp_path / 'naive'}", "--requests",
               str(tmp_path / "req.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--no-progress",
               "--dtype", "float32"])
    assert rc == 0, capsys.readouterr().err
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]

    class Out:  # check_against_hf reads RequestOutput's attributes
        def __init__(self, d):
            self.__dict__.update(d)

    got = check_against_hf([Out(o) for o in outputs], requests, HFReference(model_dir, {"naive": tmp_path / "naive"}),
                           dtype="float32", what="moelora generate vs HF+PEFT")
    assert got["compared"] > 0 and got["logprobs"] > 0 and math.isfinite(got["max_abs"])
