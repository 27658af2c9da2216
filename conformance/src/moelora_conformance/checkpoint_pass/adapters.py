"""The adapters of the real-checkpoint pass: per fixture model, three adapters of different ranks made
here (one rsLoRA, one legacy per-expert) plus every fixture adapter of the model that peft loads with
the σ its file says.

The fixtures (``moelora-conformance make-fixtures``) do not give every model an rsLoRA and a legacy
adapter of distinct ranks, so the pass builds its own into a work directory with the fixtures
builder (peft for the fused ones, the hand-written legacy keys for the per-expert one), on the same
model specs and seeds derived from their names:

- ``<model>-pass-r8``: fused experts (gate_up and down) + q, k, v, o (+ the shared expert's gate,
  up, down on a Qwen2-MoE); r 8, α 16;
- ``<model>-pass-rslora-r6``: fused experts + q, v (+ the shared expert's down); r 6, α 12, rsLoRA
  (σ = α/√r);
- ``<model>-pass-legacy-r3``: legacy per-expert gate/up/down (gate_A != up_A) + o; r 3, α 6.

On DeepSeek-V3 the attention targets are its MLA projections (q → q_a, q_b; k → kv_a; v → kv_b).

Legacy adapters under rsLoRA are left out: peft converts them with another σ (DESIGN.md §1), so no
HF+PEFT forward exists to compare with (the hf-check covers that case against a per-module
reference). So is the legacy adapter of a Qwen2-MoE: peft 0.21.2 converts legacy per-expert adapters
only for the model types its conversion table maps *to* ``qwen2_moe`` (qwen3_moe, olmoe, ...), not
for ``qwen2_moe`` itself, so it leaves the experts unwrapped and drops the per-expert keys without a
word (and its ``gate_proj`` / ``up_proj`` / ``down_proj`` targets wrap the shared expert, with
peft's initial values where the file has no keys). moelora serves the file's own modules.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from moelora_conformance.fixtures.manifest import FixtureSet
from moelora_conformance.fixtures.specs import SHARED, AdapterSpec, model_spec

#: The pass's own adapters: (suffix, AdapterSpec fields).
PASS_ADAPTERS: tuple[tuple[str, dict], ...] = (
    ("pass-r8", dict(format="fused", r=8, alpha=16, experts=("gate_up_proj", "down_proj"),
                     dense=("q", "k", "v", "o"), kinds=("pass", "fused"))),
    ("pass-rslora-r6", dict(format="fused", r=6, alpha=12, use_rslora=True, experts=("gate_up_proj", "down_proj"),
                            dense=("q", "v"), kinds=("pass", "fused", "rslora"))),
    ("pass-legacy-r3", dict(format="per_expert", r=3, alpha=6, experts=("gate", "up", "down"), dense=("o",),
                            kinds=("pass", "per-expert"))),
)


@dataclass(frozen=True)
class PassAdapter:
    """One adapter of the pass: name, directory, format, rank and rsLoRA as its config says."""

    name: str
    path: Path
    format: str
    r: int
    use_rslora: bool
    origin: str  # "pass" (built here), "fixture", or "layout" (shared-outer / fully shared: no peft)


#: The shared-expert modules each pass adapter also targets on a model with a shared expert.
SHARED_EXTRA: dict[str, tuple[str, ...]] = {"pass-r8": SHARED, "pass-rslora-r6": ("shared_down",)}
#: Families whose legacy per-expert adapters peft 0.21.2 does not convert on load (module docstring).
PEFT_UNCONVERTED_LEGACY: frozenset[str] = frozenset({"qwen2_moe"})
#: Families without a legacy per-expert adapter in the pass: those above, and GPT-OSS, whose experts
#: transformers never held as per-expert modules (no legacy adapter of it exists).
NO_LEGACY_PASS: frozenset[str] = PEFT_UNCONVERTED_LEGACY | {"gpt_oss"}


#: DeepSeek-V3: the MLA projections standing in for each attention target of the pass (its shared
#: experts and dense MLP are not peft targets: the fixture ``deepseek_v3-shared-dense`` covers them).
MLA_FOR: dict[str, tuple[str, ...]] = {"q": ("q_a", "q_b"), "k": ("kv_a",), "v": ("kv_b",), "o": ("o",)}


def pass_adapter_specs(model: str) -> list[AdapterSpec]:
    """The adapters the pass builds for fixture model ``model`` (three; two for a family in
    :data:`NO_LEGACY_PASS`, without the legacy one)."""
    mspec = model_spec(model)
    legacy = mspec.family not in NO_LEGACY_PASS
    specs = []
    for suffix, fields in PASS_ADAPTERS:
        if fields["format"] == "per_expert" and not legacy:
            continue
        if mspec.shared_inter is not None:  # the shared expert too: all three at r 8, down alone at r 6
            fields = {**fields, "dense": fields["dense"] + SHARED_EXTRA.get(suffix, ())}
        if mspec.deepseek is not None:  # MLA: each attention target becomes its MLA projections
            fields = {**fields, "dense": tuple(m for d in fields["dense"] for m in MLA_FOR[d])}
        specs.append(AdapterSpec(f"{model}-{suffix}", model, seed=zlib.crc32(f"{model}-{suffix}".encode()) % 10_000,
                                 **fields))
    return specs


def build_pass_adapters(fixtures: FixtureSet, work_dir: Path, model: str) -> list[PassAdapter]:
    """Build (or reuse, when already built in ``work_dir``) the pass's adapters for ``model``.

    Returns:
        The pass adapters first, then the model's fixture adapters peft loads faithfully.
    """
    from moelora_conformance.fixtures.adapters import build_fused_adapter, build_legacy_adapter

    out = []
    mspec = model_spec(model)
    for spec in pass_adapter_specs(model):
        directory = Path(work_dir) / "adapters" / spec.name
        if not (directory / "adapter_config.json").is_file():
            build = build_fused_adapter if spec.format == "fused" else build_legacy_adapter
            build(spec, mspec, directory)
        out.append(PassAdapter(spec.name, directory, spec.format, spec.r, spec.use_rslora, "pass"))
    for name, entry in sorted(fixtures.manifest["adapters"].items()):
        if entry["model"] != model or entry["peft_divergent"]:
            continue
        out.append(PassAdapter(name, fixtures.adapter_dir(name), entry["format"], int(entry["r"]),
                               bool(entry["use_rslora"]), "fixture"))
    return out + layout_pass_adapters(fixtures, model)


def layout_pass_adapters(fixtures: FixtureSet, model: str) -> list[PassAdapter]:
    """The model's shared-outer / fully shared fixture adapters (``layout_adapters``), compared with
    the per-module reference built from their own tensors (peft cannot load them). In the pass's
    one per-expert pool, beside per-expert adapters, their shared factors are broadcast; the
    stride-0 storage is checked by ``hf-check``, the suite and the engine tests."""
    return [PassAdapter(name, fixtures.layout_adapter_dir(name), f"{e['layout']}/{e['encoding']}", int(e["r"]),
                        False, "layout")
            for name, e in sorted(fixtures.layout_adapters().items()) if e["model"] == model]


def describe(adapters: list[PassAdapter]) -> str:
    """A short JSON line naming the adapters (for progress output and the report)."""
    return json.dumps([f"{a.name}(r{a.r}{',rs' if a.use_rslora else ''},{a.format})" for a in adapters])
