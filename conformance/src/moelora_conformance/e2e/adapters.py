"""The engine adapters of every fixture model: five PEFT adapters of five ranks and formats, built
with the fixtures builder on the model's own spec so every family gets each format (the e2e
workload's adapters, and the runner tests').

======================  ======================================================================
name suffix             what it is
======================  ======================================================================
``eng-fused-r8``        fused experts (gate_up_proj + down_proj) + q/k/v/o, r 8
``eng-rslora-r6``       fused + q/v under rsLoRA (σ = α/√r), r 6
``eng-legacy-r3``       legacy per-expert gate/up/down + o, r 3
``eng-attn-r5-fp16``    attention-only q/k/v/o, factors stored in fp16, r 5
``eng-pattern-r4``      fused with rank_pattern / alpha_pattern, module and layer keys (r 4; gate_up 2,
                        layer 1's q 7; down α 5, layer 0's k α 3)
======================  ======================================================================

On a model with a shared expert (Qwen2-MoE) the fused r 8 adapter also targets the shared expert's
gate / up / down, and the legacy one — which peft 0.21.2 does not convert for ``qwen2_moe``, so no
HF + PEFT forward exists (``moelora_conformance.checkpoint_pass.adapters``) — is replaced by a
shared-expert + o adapter (``eng-shared-r3``).

On DeepSeek-V3 (run only when ``--families`` names it) the attention targets are its MLA projections
(q → q_a, q_b; k → kv_a; v → kv_b), in the patterns too.

Building needs the ``fixtures`` extra (transformers + peft).
"""

from __future__ import annotations

import warnings
import zlib
from pathlib import Path

#: (suffix, AdapterSpec fields) of the engine adapters.
ENGINE_ADAPTERS: tuple[tuple[str, dict], ...] = (
    ("eng-fused-r8", dict(format="fused", r=8, alpha=16, experts=("gate_up_proj", "down_proj"),
                          dense=("q", "k", "v", "o"))),
    ("eng-rslora-r6", dict(format="fused", r=6, alpha=12, use_rslora=True, experts=("gate_up_proj", "down_proj"),
                           dense=("q", "v"))),
    ("eng-legacy-r3", dict(format="per_expert", r=3, alpha=6, experts=("gate", "up", "down"), dense=("o",))),
    ("eng-attn-r5-fp16", dict(format="fused", r=5, alpha=10, experts=(), dense=("q", "k", "v", "o"),
                              stored_dtype="float16")),
    ("eng-pattern-r4", dict(format="fused", r=4, alpha=8, experts=("gate_up_proj", "down_proj"), dense=("q", "k"),
                            rank_pattern={"gate_up_proj": 2, "layers.1.self_attn.q_proj": 7},
                            alpha_pattern={"down_proj": 5, "layers.0.self_attn.k_proj": 3})),
)
#: On a model with a shared expert: the adapters that change, by suffix (see the module docstring).
SHARED_EXPERT_ADAPTERS: dict[str, tuple[str, dict]] = {
    "eng-fused-r8": ("eng-fused-r8", dict(format="fused", r=8, alpha=16, experts=("gate_up_proj", "down_proj"),
                                          dense=("q", "k", "v", "o", "shared_gate", "shared_up", "shared_down"))),
    "eng-legacy-r3": ("eng-shared-r3", dict(format="fused", r=3, alpha=6, experts=(),
                                            dense=("o", "shared_gate", "shared_up", "shared_down"))),
}
#: The file :func:`build_engine_adapters` writes last (the directory is complete once it exists).
DONE = "done"


def model_names() -> list[str]:
    """Every fixture model's name (``moelora_conformance.fixtures.specs.MODELS``)."""
    from moelora_conformance.fixtures.specs import MODELS

    return [m.name for m in MODELS]


def opt_in_model_names() -> list[str]:
    """Fixture models the e2e suite runs only when ``--families`` names them (outside its CI-sized
    default): DeepSeek-V3 and the fp8 block-scaled copies (``ALL_FP8_MODELS``: the opt-in fixtures'
    ones built on request)."""
    from moelora_conformance.fixtures.specs import ALL_FP8_MODELS, DEEPSEEK_V3

    return [DEEPSEEK_V3.name, *(m.name for m in ALL_FP8_MODELS)]


def adapter_source(model: str) -> str:
    """The fixture model whose engine adapters ``model`` serves: an fp8 copy serves its source's
    (``quantized_from``: an adapter trained on Qwen3-30B-A3B is served on -FP8); any other model its own."""
    from moelora_conformance.fixtures.specs import ALL_FP8_MODELS

    return next((m.quantized_from for m in ALL_FP8_MODELS if m.name == model), model)


def _mla_fields(fields: dict) -> dict:
    """DeepSeek-V3: each attention target becomes its MLA projections (q → q_a, q_b; k → kv_a;
    v → kv_b), the patterns' attention keys too."""
    from moelora_conformance.checkpoint_pass.adapters import MLA_FOR

    leaves = {"q_proj": "q_b_proj", "k_proj": "kv_a_proj_with_mqa", "v_proj": "kv_b_proj"}

    def key(k: str) -> str:
        return next((k.replace(a, b) for a, b in leaves.items() if k.endswith(a)), k)

    return {**fields, "dense": tuple(m for d in fields["dense"] for m in MLA_FOR[d]),
            "rank_pattern": {key(k): v for k, v in fields.get("rank_pattern", {}).items()},
            "alpha_pattern": {key(k): v for k, v in fields.get("alpha_pattern", {}).items()}}


def engine_adapter_specs(model: str) -> list[tuple[str, dict]]:
    """(suffix, AdapterSpec fields) of ``model``'s engine adapters (an fp8 copy's: its source's)."""
    from moelora_conformance.fixtures.specs import model_spec

    model = adapter_source(model)

    if model_spec(model).deepseek is not None:
        return [(suffix, _mla_fields(fields)) for suffix, fields in ENGINE_ADAPTERS]
    if model_spec(model).shared_inter is None:
        return list(ENGINE_ADAPTERS)
    return [SHARED_EXPERT_ADAPTERS.get(suffix, (suffix, fields)) for suffix, fields in ENGINE_ADAPTERS]


def build_engine_adapters(root: Path, models: list[str] | None = None) -> None:
    """Build the engine adapters of ``models`` (default every fixture model) under
    ``root/<model>/<model>-<suffix>``, then ``root/done`` (an fp8 copy's are its source's, built under
    the source's name)."""
    from moelora_conformance.fixtures.adapters import build_fused_adapter, build_legacy_adapter
    from moelora_conformance.fixtures.specs import AdapterSpec, model_spec

    for model in sorted({adapter_source(m) for m in models or model_names()}):
        mspec = model_spec(model)
        for suffix, fields in engine_adapter_specs(model):
            name = f"{model}-{suffix}"
            spec = AdapterSpec(name, model, seed=zlib.crc32(name.encode()) % 10_000, **fields)
            build = build_fused_adapter if spec.format == "fused" else build_legacy_adapter
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build(spec, mspec, Path(root) / model / name)
    (Path(root) / DONE).write_text("ok\n")


def engine_adapter_dirs(root: Path, models: list[str] | None = None) -> dict[str, list[tuple[str, Path]]]:
    """model → [(adapter name, directory)] of the engine adapters under ``root`` (an fp8 copy: its
    source's adapters)."""
    return {model: [(f"{src}-{suffix}", Path(root) / src / f"{src}-{suffix}")
                    for suffix, _ in engine_adapter_specs(model)]
            for model in models or model_names() for src in (adapter_source(model),)}


def session_engine_adapters(tmp_path_factory) -> dict[str, list[tuple[str, Path]]]:
    """model → [(adapter name, directory)] of the engine adapters of every fixture model, built once
    per test session in a directory every pytest worker shares (the runner's and the e2e tests'
    ``engine_adapters`` fixture; ``moelora_conformance.fixtures.cache.shared_directory``)."""
    from moelora_conformance.fixtures.cache import shared_directory

    root = shared_directory(tmp_path_factory, "moelora-engine-adapters", build_engine_adapters, marker=DONE)
    return engine_adapter_dirs(root)
