"""Whole-model prompt logprobs: moelora's engine against HF transformers + PEFT (DESIGN.md §1, §2).

hf-check's other rows compare one decoder layer at a time on random inputs. For the families whose
model is more than a stack of those layers' parts — DeepSeek-V3 / Kimi-K2 (:data:`MODEL_FAMILIES`):
dense first layers, ungated shared experts added to the routed sum, MLA with YaRN and interleaved
RoPE between them — this module adds one row per (model, adapter), part ``logprobs``: the engine
(``moelora_runner.Engine``, reference backend, eager, fp32 on the CPU) serves a few prompts of each
adapter and of the base model in one mixed batch, and every prompt logprob equals HF + PEFT
teacher-forced on the same tokens within the tolerance policy's ``engine_vs_hf`` row (each within
its max, all on average within its mean). Adapters peft cannot load or serves with other σ
(the shared-outer / fully shared ``layout_adapters``, legacy per-expert rsLoRA) are held to the
per-module reference instead, the file's own deltas merged into transformers' weights, as the
engine tests do.

Rows come only where the engine (``moelora_runner``) is installed, as the reference-backend rows
come only with the reference backend; fp8 block-scaled models are left out (transformers on a CPU
computes them without the activation quantization the engine's w8a8 base does).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable

import torch

from moelora_conformance.fixtures.manifest import FixtureSet
from moelora_conformance.hf_check.compare import CheckRow
from moelora_conformance.user_files import pool_max_rank

#: ``model_type`` of the families that get whole-model rows.
MODEL_FAMILIES = ("deepseek_v3",)
#: Prompts per adapter (and for the base model), and their lengths (inclusive).
PROMPTS = 2
PROMPT_LEN = (6, 14)
PART = "logprobs"


def engine_available() -> bool:
    """Whether ``moelora_runner`` (the engine) is installed: found, not imported (a broken install
    then fails where the engine is used, with its own error, instead of reading as "not installed")."""
    return importlib.util.find_spec("moelora_runner") is not None


def wants_model_rows(cfg) -> bool:
    """Whether a model of config ``cfg`` (``MoEModelConfig``) gets whole-model rows."""
    return cfg.family.model_type in MODEL_FAMILIES and cfg.base_quant == "none"


def _requests(names: list[str | None], vocab: int, seed: int) -> list[dict]:
    """``PROMPTS`` requests per name (None = base) of random prompts, prompt logprobs only."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(PROMPTS * len(names)):
        length = int(torch.randint(PROMPT_LEN[0], PROMPT_LEN[1] + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        out.append(dict(request_id=f"p{i}", prompt_token_ids=ids, adapter=names[i % len(names)],
                        max_new_tokens=0, prompt_logprobs=True))
    return out


def model_logprob_rows(fixtures: FixtureSet, model: str, adapters: list[str], *, seed: int = 0,
                       prepare: Callable[[object], None] | None = None) -> list[CheckRow]:
    """One ``logprobs`` row per adapter of ``adapters`` (fixture or layout adapters of ``model``) and one
    for the base model (module docstring); none without the engine or for a model outside
    :data:`MODEL_FAMILIES`.

    A request the engine refuses or fails on, or a logprob out of bounds, makes its adapter's row fail
    with the error as its note. ``prepare`` is called on the engine before it serves (a faulty
    variant: ``faulty.routing_faults.make_engine_faulty``). ``max_rel`` / ``rms_rel`` of a row hold
    the largest and the mean absolute logprob difference (natural log), not relative errors.
    """
    from moelora_core.checkpoint import read_model_config

    model_dir = fixtures.model_dir(model)
    cfg = read_model_config(model_dir)
    if not engine_available() or not wants_model_rows(cfg):
        return []
    from moelora_conformance.e2e.engine_checks import HFReference, PerModuleReference, check_against_hf
    from moelora_runner import Engine

    layout = fixtures.layout_adapters()
    dirs, per_module = {}, {}
    for name in adapters:
        if name in layout:
            dirs[name], per_module[name] = fixtures.layout_adapter_dir(name), True
        else:
            entry = fixtures.adapter(name)
            dirs[name], per_module[name] = fixtures.adapter_dir(name), bool(entry["peft_divergent"])
    hf = HFReference(model_dir, {n: d for n, d in dirs.items() if not per_module[n]})
    merged = PerModuleReference(model_dir, {n: d for n, d in dirs.items() if per_module[n]})
    names: list[str | None] = [None, *adapters]
    requests = _requests(names, cfg.vocab_size, seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = Engine(model_dir, max_loras=max(1, len(adapters)), max_lora_rank=pool_max_rank(fixtures),
                            graph="eager", decode_graph=False)
            for name, path in dirs.items():
                engine.load_adapter(name, path)
            if prepare is not None:
                prepare(engine)
            outputs = engine.generate(requests)
    except Exception as exc:  # the engine's refusal or failure is this check's finding, on every row
        note = f"engine: {type(exc).__name__}: {exc}"
        return [CheckRow(model, "(base)" if n is None else n, "engine", -1, PART, float("nan"), float("nan"), None,
                         False, "equal", note) for n in names]
    rows = []
    for name in names:
        mine = [(r, o) for r, o in zip(requests, outputs, strict=True) if r["adapter"] == name]
        ref = merged if name is not None and per_module[name] else hf
        label = "(base)" if name is None else name
        try:
            got = check_against_hf([o for _, o in mine], [r for r, _ in mine], ref, what=f"{model} {label}")
            rows.append(CheckRow(model, label, "engine", -1, PART, got["max_abs"], got["mean_abs"], None, True,
                                 "equal", f"{got['logprobs']} prompt logprobs"))
        except AssertionError as exc:
            rows.append(CheckRow(model, label, "engine", -1, PART, float("nan"), float("nan"), None, False, "equal",
                                 str(exc)))
    return rows

