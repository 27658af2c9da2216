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

Each LoRA delta is a visible fraction of its output (> 10 %), so an ignored, doubled or transposed
delta fails by far more than the tolerance. The documented peft divergence (legacy + rsLoRA) is
asserted in test_hf_legacy_rslora.py.
"""

import pytest

from moelora_conformance.fixtures import ADAPTERS, MODELS
from moelora_conformance.hf_check import check_adapter, check_model_base

VISIBLE = 0.1


def _failures(rows):
    bad = [r for r in rows if not r.ok]
    return "\n".join(f"{r.source} L{r.layer} {r.part}: max_rel={r.max_rel:.3e} {r.note}" for r in bad[:10])


@pytest.mark.parametrize("model", [m.name for m in MODELS])
def test_oracle_without_adapter_equals_hf_base(fixture_set, model):
    rows = check_model_base(fixture_set, model)
    assert {r.source for r in rows} == {"hf-memory", "readers"}
    assert {r.part for r in rows} == {"routing", "moe", "q", "k", "v", "o"}
    assert len(rows) == 2 * 2 * 6  # two sources × two layers × six parts
    assert all(r.ok for r in rows), _failures(rows)


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
