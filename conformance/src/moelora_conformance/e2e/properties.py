"""The e2e suite's properties: stable ids (E01..), promises and the engine modes each has.

Ids never change meaning: manifests, reports and support matrices key on them, as on the layer
suite's P01..P13 (:mod:`moelora_conformance.properties.registry`).
"""

from __future__ import annotations

from moelora_conformance.e2e.results import E2E_MODES, MIXED_MODE
from moelora_conformance.properties.registry import Property

_GRAPH_MODES = tuple(m for m in E2E_MODES if m != "eager")

#: The id of the stateful engine properties (``moelora_conformance.e2e.stateful``).
STATEFUL = "E06"

E2E_PROPERTIES: dict[str, Property] = {p.id: p for p in (
    Property("E01", "graph replay equals eager on the whole workload: prompt and per-token logprobs within "
             "graph_vs_eager, greedy tokens where the margin allows", _GRAPH_MODES),
    Property("E02", "every request equals HF + PEFT run alone with its adapter (fp32, CPU): logprobs within "
             "engine_vs_hf, greedy tokens where the margin allows", E2E_MODES),
    Property("E03", "every step that fits a captured graph ran on it (no eager pass)", _GRAPH_MODES),
    Property("E04", "a step beyond capacity (more requests or tokens than captured) runs eagerly, counted with "
             "its reason", _GRAPH_MODES),
    Property("E05", "the workload is what it claims: 64 ragged requests, >= 3 adapter ranks with rsLoRA and "
             "legacy per-expert, base requests, prefills and decodes in one step, slots evicted and reused",
             E2E_MODES),
    Property(STATEFUL, "stateful engine histories (load / unload / reload / pin / evict / idle / add request): "
             "every request equals itself alone on a fresh engine; no request served by another adapter; "
             "everything freed at the end; a refused load changes nothing", (MIXED_MODE,)),
)}
