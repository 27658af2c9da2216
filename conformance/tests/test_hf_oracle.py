"""The oracle against HF transformers + PEFT on every fixture (DESIGN.md §2; ``docs/checkpoints.md``).

For every fixture model: the oracle without adapter equals the transformers base layers (MoE block,
routing, q/k/v/o), with weights from the in-memory modules and from moelora's readers. For every
fixture adapter, fp32, max and RMS relative error <= 1e-5 (DEFAULT_POLICY), topk_ids exact:

- ``hf-memory``: weights taken from the in-memory transformers / peft modules;
- ``readers``: everything read from disk by moelora_core.checkpoint, loaded with
  load_adapter_into_slot (slot 1), and every module's rank and σ equal to peft's (manifest);
- ``per-module``: legacy per-expert adapters against a reference with each module's delta merged
  into transformers' weights;
- ``reference-backend``: the readers' pools through moelora_reference's backend on a mixed batch
  (adapter request + base request): adapter rows equal HF+PEFT, base rows equal HF without adapter.

Shared-outer / fully shared adapters (3-D and 2-D encodings; peft cannot load them): the readers,
in a pool of the adapter's expert layout (shared factors once per slot, read with expert stride 0),
and the reference backend on it, against the per-module reference built from the file's own tensors.

Qwen2-MoE: the MoE block is transformers' whole ``Qwen2MoeSparseMoeBlock`` (routed + gated shared
expert) and the shared expert's projections are compared like q/k/v/o; an oracle that leaves out
the shared expert, or its LoRA, fails (``test_the_block_needs_the_shared_expert_and_its_lora``).

Each LoRA delta is a visible fraction of its output (> 10 %), so an ignored, doubled or transposed
delta fails by far more than the tolerance. The documented peft divergence (legacy + rsLoRA) is
asserted in test_hf_legacy_rslora.py.
"""

import pytest

from moelora_conformance.fixtures import ADAPTERS, LAYOUT_ADAPTERS, MODELS
from moelora_conformance.fixtures.specs import SHARED, model_spec
from moelora_conformance.hf_check import check_adapter, check_layout_adapter, check_model_base

VISIBLE = 0.1


def _failures(rows):
    bad = [r for r in rows if not r.ok]
    return "\n".join(f"{r.source} L{r.layer} {r.part}: max_rel={r.max_rel:.3e} {r.note}" for r in bad[:10])


@pytest.mark.parametrize("model", [m.name for m in MODELS])
def test_oracle_without_adapter_equals_hf_base(fixture_set, model):
    rows = check_model_base(fixture_set, model)
    assert {r.source for r in rows} == {"hf-memory", "readers"}
    dense = {"q", "k", "v", "o"} | (set(SHARED) if model_spec(model).shared_inter else set())
    assert {r.part for r in rows} == {"routing", "moe"} | dense
    assert len(rows) == 2 * 2 * (2 + len(dense))  # two sources × two layers × the parts
    assert all(r.ok for r in rows), _failures(rows)


@pytest.mark.parametrize("spec", LAYOUT_ADAPTERS, ids=lambda s: s.name)
def test_shared_expert_layouts_equal_the_per_module_reference(fixture_set, spec):
    rows = check_layout_adapter(fixture_set, spec.name)
    assert all(r.ok for r in rows), _failures(rows)
    assert {r.source for r in rows} == {"readers", "per-module", "reference-backend"}
    assert [r.part for r in rows if r.source == "readers"] == ["rank/σ", "layout"]
    for r in rows:
        if r.source == "per-module" and r.part in {"moe", *spec.dense}:
            assert r.delta_rel is not None and r.delta_rel > VISIBLE, (r.layer, r.part, r.delta_rel)


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_oracle_with_adapter_equals_hf_peft(fixture_set, spec):
    rows = check_adapter(fixture_set, spec.name)
    assert all(r.ok for r in rows), _failures(rows)
    sources = {r.source for r in rows}
    assert {"hf-memory", "readers", "reference-backend"} <= sources
    backend_parts = {r.part for r in rows if r.source == "reference-backend"}
    assert {"moe", "moe base rows", "q", "q base rows"} <= backend_parts
    assert ("per-module" in sources) == (spec.format == "per_expert")
    assert [r.part for r in rows if r.part == "rank/σ"] == ["rank/σ"]
    # Every module the adapter holds changes its output visibly, on both paths.
    lora_parts = {"moe"} | set(spec.dense)
    for r in rows:
        if r.source in ("hf-memory", "readers") and r.part in lora_parts:
            assert r.delta_rel is not None and r.delta_rel > VISIBLE, (r.source, r.layer, r.part, r.delta_rel)
    compared = {(r.source, r.part) for r in rows if r.part not in ("routing", "rank/σ")}
    assert {("readers", "moe"), ("hf-memory", "moe")} <= compared


def test_the_block_needs_the_shared_expert_and_its_lora(fixture_set):
    # The same comparison as hf-check's "readers" rows, with the oracle's shared expert dropped, or its
    # LoRA dropped (the slot's shared modules cleared): the MoE block must then differ from HF + PEFT.
    from moelora_conformance.fixtures.specs import POOL_MAX_RANK
    from moelora_conformance.hf_check import hf_model
    from moelora_conformance.hf_check.compare import SLOT, compare_layer
    from moelora_core import LoRAWeights, ModuleLoRA
    from moelora_core.checkpoint import MoECheckpoint, load_adapter_into_slot, read_adapter

    adapter = "qwen2_moe-shared-only"
    model_dir, adapter_dir = fixture_set.model_dir("qwen2_moe"), fixture_set.adapter_dir(adapter)
    layer = hf_model.decoder_layers(hf_model.load_hf(model_dir, adapter_dir))[0]
    side = dict(hf_moe=lambda x: hf_model.hf_moe(layer, x), hf_route=lambda x: hf_model.hf_route(layer, x),
                hf_dense=lambda m, x: hf_model.hf_dense(layer, m, x))
    with MoECheckpoint(model_dir) as ckpt:
        cfg, disk = ckpt.config, ckpt.layer(0)
    read = read_adapter(adapter_dir, cfg, max_rank=POOL_MAX_RANK)
    spec = cfg.layer_spec(max_loras=SLOT + 1, max_rank=POOL_MAX_RANK)
    pools = [LoRAWeights(spec) for _ in range(cfg.num_layers)]
    load_adapter_into_slot(pools, SLOT, read)
    common = dict(model="qwen2_moe", adapter=adapter, source="readers", layer=0, moe=disk.moe, dense={},
                  top_k=cfg.top_k, seed=3, **side)

    def moe_ok(pool, shared) -> bool:
        (row,) = [r for r in compare_layer(pool=pool, shared=shared, **common) if r.part == "moe"]
        return row.ok

    assert moe_ok(pools[0], disk.shared_expert)
    assert not moe_ok(pools[0], None)  # the routed experts alone
    no_shared_lora = LoRAWeights(spec)
    no_shared_lora.load_slot(SLOT, {m: ModuleLoRA(*((0.0 * t) for t in (lo.lora_A, lo.lora_B)), lo.scaling)
                                    for m, lo in read.layers[0].items()})
    assert not moe_ok(no_shared_lora, disk.shared_expert)  # the shared expert without its LoRA


# --- GPT-OSS: in the fixture set and its manifest, beside MODELS (fixtures.specs.GPT_OSS) --------------


def test_gpt_oss_oracle_without_adapter_equals_hf_base(fixture_set):
    from moelora_conformance.fixtures.specs import GPT_OSS

    rows = check_model_base(fixture_set, GPT_OSS.name)
    assert {r.source for r in rows} == {"hf-memory", "readers"}
    assert {r.part for r in rows} == {"routing", "moe", "q", "k", "v", "o"}
    assert all(r.ok for r in rows), _failures(rows)


@pytest.mark.parametrize("name", ["gpt_oss-r8", "gpt_oss-rslora"])
def test_gpt_oss_oracle_with_adapter_equals_hf_peft(fixture_set, name):
    # interleaved gate/up B read 0::2 / 1::2, expert and router biases, swiglu_oai, o's bias
    from moelora_conformance.fixtures.specs import GPT_OSS_ADAPTERS

    spec = next(s for s in GPT_OSS_ADAPTERS if s.name == name)
    rows = check_adapter(fixture_set, name)
    assert all(r.ok for r in rows), _failures(rows)
    assert {"hf-memory", "readers", "reference-backend"} <= {r.source for r in rows}
    for r in rows:
        if r.source in ("hf-memory", "readers") and r.part in {"moe", *spec.dense}:
            assert r.delta_rel is not None and r.delta_rel > VISIBLE, (r.source, r.layer, r.part, r.delta_rel)
