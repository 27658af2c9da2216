"""Adapters as real PEFT files, built inside the suite, and what they must mean (P13).

Loader faults never enter a run whose adapters the suite draws as tensors (an rsLoRA flag dropped
while parsing ``adapter_config.json``, a fused lora_B read expert-major): so some draws write real
adapter directories — with peft for the fused ``target_parameters`` format, by hand with peft's
config writer for the legacy per-expert one (the fixtures builder's code,
:mod:`moelora_conformance.fixtures.adapters`) — and load them through moelora's readers
(``read_adapter`` → ``load_adapter_into_slot``) in the process that built the backend, after its
factory ran. The expected values come from the files independently of those readers:

- fused: peft's own in-memory layers (``hf_check.extract.lora_from_peft``: peft's reshape, checked
  against its ``get_delta_weight``), σ as peft computes it (rsLoRA, ``rank_pattern``,
  ``alpha_pattern``); the factors are cast to the stored dtype before saving, so memory and file agree;
- legacy per-expert: a per-module reference — the file's tensors read with safetensors by their
  keys, σ = α/r or α/√r from the config (DESIGN.md §1: the file's own modules).

:class:`FileAdapter` is the drawn structure (:func:`file_adapters`); :class:`PeftFiles` builds
files into a work directory (a base transformers model per geometry is built once and copied).
Needs the ``fixtures`` extra (transformers, peft); :func:`peft_available` says whether it is there.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import strategies as st

from moelora_conformance.strategies.adapters import SlotAdapter, sigmas
from moelora_conformance.strategies.choice import uniform, weighted
from moelora_conformance.strategies.shapes import LayerShape
from moelora_core.weights import ModuleLoRA

#: File formats drawn, the simplest (first, what Hypothesis tries first) fused.
FORMATS = ("fused", "legacy")
#: Stored dtypes of the factors.
STORED = ("float32", "float16", "bfloat16")
_LEAF = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def pattern_value(pattern: tuple[tuple[str, object], ...], module_path: str, default):
    """The value ``pattern`` gives the module at ``module_path`` (its path in the transformers model:
    ``model.layers.1.mlp.experts.down_proj``), or ``default``: peft 0.21.2's own matching
    (``peft.utils.other.get_pattern_key``: the first key, in file order, with
    ``re.match(rf"(.*\\.)?({key})$", module_path)``), called here so the suite's description of a file
    cannot drift from peft's reading of it."""
    from peft.utils.other import get_pattern_key

    values = dict(pattern)
    return values.get(get_pattern_key(list(values), module_path), default)


def peft_available() -> bool:
    """Whether transformers and peft (the ``fixtures`` extra) are importable."""
    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft"))


@dataclass(frozen=True)
class Geometry:
    """The attention geometry of a layer whose adapters are files: q is H → heads·head_dim, k and v
    H → kv_heads·head_dim, o heads·head_dim → H (a Qwen3-MoE model has all four)."""

    heads: int
    kv_heads: int
    head_dim: int

    def dense_shapes(self, hidden: int, modules: tuple[str, ...]) -> tuple[tuple[str, tuple[int, int]], ...]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dims = {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden)}
        return tuple((m, dims[m]) for m in ("q", "k", "v", "o") if m in modules)


@dataclass(frozen=True)
class FileAdapter:
    """One adapter directory's structure.

    Attributes:
        format: "fused" (peft ``target_parameters``) or "legacy" (per-expert keys).
        r, alpha, use_rslora: the config's r, lora_alpha, use_rslora.
        experts: fused: ``gate_up_proj`` / ``down_proj``; legacy: ``gate`` / ``up`` / ``down``.
        dense: attention modules targeted ("q".."o").
        rank_pattern, alpha_pattern: fused only: ((key, value), ...) in file order (sorted: peft writes
            the config with sorted keys); a key is a module leaf (``down_proj``: every layer) or names a
            layer (``layers.1.mlp.experts.down_proj``, ``layers\\.0\\..*q_proj``), matched as peft
            matches it (:func:`pattern_value`).
        stored_dtype: the factors' dtype in the file. seed: the factors' seed.
        layers: the decoder layers the file covers (the keys naming a layer count on them).
    """

    format: str
    r: int
    alpha: float
    use_rslora: bool
    experts: tuple[str, ...]
    dense: tuple[str, ...]
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    stored_dtype: str = "float32"
    seed: int = 0
    layers: int = 1

    def modules(self, layer: int | None = None) -> tuple[tuple[str, int, float], ...]:
        """((moelora module, rank, α), ...) the file holds in decoder layer ``layer``, patterns applied
        (its σ = α/r or α/√r); ``layer`` None: per module the largest rank over the layers (what a
        scheduler sees as the slot's rank), with layer 0's α."""
        if layer is None:
            per_layer = [self.modules(n) for n in range(self.layers)]
            return tuple((m, max(mods[i][1] for mods in per_layer), a) for i, (m, _, a) in enumerate(per_layer[0]))
        out = []
        for target in self.experts:
            names = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}.get(target, (target,))
            path = f"model.layers.{layer}.mlp.experts.{target}"
            for m in names:
                out.append((m, pattern_value(self.rank_pattern, path, self.r),
                            pattern_value(self.alpha_pattern, path, self.alpha)))
        for m in self.dense:
            path = f"model.layers.{layer}.self_attn.{_LEAF[m]}"
            out.append((m, pattern_value(self.rank_pattern, path, self.r),
                        pattern_value(self.alpha_pattern, path, self.alpha)))
        order = ("gate", "up", "down", "q", "k", "v", "o")
        return tuple(sorted(out, key=lambda t: order.index(t[0])))

    def slot_adapter(self) -> SlotAdapter:
        """The adapter as the suite's other draws describe one (ranks and σ for ``BatchSpec``: the slot's
        rank is the largest over every layer's modules, as the engine's ``AdapterPool.slot_ranks``)."""
        return SlotAdapter(self.r, self.alpha, self.use_rslora, self.modules())

    def describe(self) -> str:
        pat = f" ranks{dict(self.rank_pattern)}" if self.rank_pattern else ""
        pat += f" alphas{dict(self.alpha_pattern)}" if self.alpha_pattern else ""
        return (f"{self.format} r{self.r}/a{self.alpha:g}{'/rs' if self.use_rslora else ''} "
                f"[{','.join((*self.experts, *self.dense))}]{pat} {self.stored_dtype}")


@st.composite
def geometries(draw, max_hidden: int) -> Geometry:
    """A Qwen3-MoE attention geometry with q, k, v widths within ``max_hidden``."""
    heads = draw(uniform((1, 2, 4)))
    kv = draw(uniform([d for d in (1, 2, 4) if heads % d == 0]))
    head_dim = draw(st.integers(2, max(2, max_hidden // heads)))
    return Geometry(heads, kv, head_dim)


def _pattern_keys(draw, leaf: str, block: str, layers: int) -> list[str]:
    """The keys of one target's pattern entries: its leaf (every layer), or one or two keys naming a
    layer — ``layers.{n}.{block}.{leaf}`` or peft's regex form ``layers\\.{n}\\..*{leaf}`` — alone or
    beside the leaf key (which of two matching keys wins is then decided by the file's key order)."""
    # keys naming a layer three times in four where there are layers to tell apart: they are what a
    # reader giving every layer layer 0's σ gets wrong (P13 eager should meet them within its examples)
    if layers < 2 or not draw(weighted([(False, 1), (True, 3)])):
        return [leaf]
    named = [draw(uniform((f"layers.{n}.{block}.{leaf}", rf"layers\.{n}\..*{leaf}")))
             for n in sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1, max_size=layers)))]
    # beside the leaf key one time in four: in sorted order "down_proj" / "gate_up_proj" / "k_proj" come
    # before "layers…" and shadow it, "o_proj" / "q_proj" / "v_proj" after it and are shadowed
    return named if draw(weighted([(True, 3), (False, 1)])) else [*named, leaf]


@st.composite
def file_adapters(draw, shape: LayerShape, *, experts_lacking: tuple[str, ...] = (), layers: int = 1) -> FileAdapter:
    """An adapter file for a layer of ``shape`` (ranks within R, dense targets among the shape's).

    The simplest draw — the first example Hypothesis tries — is a fused rsLoRA adapter of rank 2
    (where R allows). Fused files draw ``rank_pattern`` / ``alpha_pattern`` on some targets, keyed by
    the module leaf or, with ``layers`` > 1, by keys naming a layer (:func:`_pattern_keys`), so a
    reader that gives every layer layer 0's rank or σ reads another adapter than the file.

    Args:
        experts_lacking: MoE modules the adapter must not target (a reload that drops modules).
        layers: the decoder layers of the model the file is built for.
    """
    R = shape.max_rank
    fmt = draw(uniform(FORMATS))
    # rank 2 first: at r = 1, α/√r = α/r and an rsLoRA file would hide a dropped rsLoRA flag
    r = draw(uniform(sorted(range(1, R + 1), key=lambda v: (v != 2, v))))
    rslora = draw(uniform((True, False)))
    sigma = draw(sigmas())
    alpha = sigma * (math.sqrt(r) if rslora else r)
    dense = tuple(m for m, _ in shape.dense_shapes if draw(st.booleans()))
    if fmt == "fused":
        pool = [t for t in ("gate_up_proj", "down_proj")
                if not set({"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}[t]) & set(experts_lacking)]
    else:
        pool = [m for m in ("gate", "up", "down") if m not in experts_lacking]
    experts = tuple(t for t in pool if draw(st.booleans())) if pool else ()
    if not experts and not dense:
        experts = tuple(pool[:1]) or ()
        if not experts:
            dense = tuple(m for m, _ in shape.dense_shapes[:1])
    ranks, alphas = (), ()
    # patterns more often where layers can differ (three times in four; half the time otherwise)
    often = weighted([(False, 1), (True, 3 if layers > 1 else 1)])
    if fmt == "fused" and draw(often):  # rank_pattern / alpha_pattern on some targets
        leaves = [(t, "mlp.experts") for t in experts] + [(_LEAF[m], "self_attn") for m in dense]
        ranks, alphas = [], []
        for values, value in ((ranks, lambda: draw(st.integers(1, R))), (alphas, lambda: round(draw(sigmas()) * r, 4))):
            for leaf, block in leaves:
                if draw(often):  # a value per key: layers named apart differ from each other
                    values += [(key, value()) for key in _pattern_keys(draw, leaf, block, layers)]
        leaf = draw(uniform(experts)) if layers > 1 and experts and draw(often) else None
        if leaf is not None and not any(k.endswith(leaf) for k, _ in alphas):
            # an expert target's α set for one layer alone: a reader giving every layer layer 0's σ
            # reads another σ there (every MoE layer of a case runs its expert deltas)
            n = draw(st.integers(0, layers - 1))
            key = draw(uniform((f"layers.{n}.mlp.experts.{leaf}", rf"layers\.{n}\..*{leaf}")))
            alphas.append((key, round(draw(sigmas()) * r * 1.5, 4)))
        # In the file's order: peft 0.21.2 writes adapter_config.json with sort_keys=True and resolves a
        # module by the first matching key, so a file means its patterns in sorted key order whatever
        # order the LoraConfig held (peft's in-memory model of another order disagrees with its own file)
        ranks, alphas = tuple(sorted(ranks)), tuple(sorted(alphas))
    stored = draw(uniform(STORED))
    seed = draw(st.integers(0, 2**16))
    return FileAdapter(fmt, r, round(alpha, 6), rslora, experts, dense, ranks, alphas, stored, seed, layers)


@dataclass
class BuiltAdapter:
    """An adapter directory and what it means.

    Attributes:
        path: the directory. expected: per decoder layer, module → factors and σ as the file means
            them (peft's reading or the per-module reference). scaling: the adapter-level σ.
    """

    path: Path
    expected: list[dict[str, ModuleLoRA]]
    scaling: float


@dataclass
class PeftFiles:
    """Builds adapter files into ``workdir`` (module docstring)."""

    workdir: Path
    _models: dict = field(default_factory=dict, repr=False)
    _count: int = 0

    def _model_spec(self, shape: LayerShape, geometry: Geometry, layers: int):
        from moelora_conformance.fixtures.specs import ModelSpec

        return ModelSpec(f"suite-h{shape.hidden_size}-i{shape.moe_intermediate_size}-e{shape.num_experts}-"
                         f"k{shape.top_k}-{geometry.heads}x{geometry.kv_heads}x{geometry.head_dim}-l{layers}",
                         "qwen3_moe", hidden=shape.hidden_size, inter=shape.moe_intermediate_size,
                         experts=shape.num_experts, top_k=shape.top_k, layers=layers, heads=geometry.heads,
                         kv_heads=geometry.kv_heads, head_dim=geometry.head_dim, vocab=8)

    def model(self, shape: LayerShape, geometry: Geometry, layers: int):
        """(ModelSpec, a base transformers model of it, its config directory) — built once per geometry."""
        spec = self._model_spec(shape, geometry, layers)
        if spec.name not in self._models:
            from transformers import AutoModelForCausalLM

            from moelora_conformance.fixtures.models import hf_config

            config = hf_config(spec)
            directory = self.workdir / "models" / spec.name
            config.save_pretrained(directory)
            self._models[spec.name] = (spec, AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(),
                                       directory)
        return self._models[spec.name]

    def build(self, adapter: FileAdapter, shape: LayerShape, geometry: Geometry, layers: int) -> BuiltAdapter:
        """Write ``adapter`` for a model of ``shape`` / ``geometry`` with ``layers`` decoder layers."""
        from moelora_conformance.fixtures.specs import AdapterSpec

        mspec, base, _ = self.model(shape, geometry, layers)
        self._count += 1
        directory = self.workdir / "adapters" / f"a{self._count}"
        spec = AdapterSpec(directory.name, mspec.name, format="fused" if adapter.format == "fused" else "per_expert",
                           r=adapter.r, alpha=adapter.alpha, use_rslora=adapter.use_rslora,
                           rank_pattern=dict(adapter.rank_pattern), alpha_pattern=dict(adapter.alpha_pattern),
                           experts=adapter.experts, dense=adapter.dense, stored_dtype=adapter.stored_dtype,
                           seed=adapter.seed)
        scaling = adapter.alpha / (math.sqrt(adapter.r) if adapter.use_rslora else adapter.r)
        if adapter.format == "fused":
            expected = _build_fused(spec, mspec, copy.deepcopy(base), directory)
        else:
            from moelora_conformance.fixtures.adapters import build_legacy_adapter

            build_legacy_adapter(spec, mspec, directory)
            expected = _per_module_reference(directory, mspec)
        return BuiltAdapter(directory, expected, scaling)

    def model_config(self, shape: LayerShape, geometry: Geometry, layers: int):
        """The ``MoEModelConfig`` moelora's reader reads the adapters for (from the model's config.json)."""
        from moelora_core.checkpoint import read_model_config

        return read_model_config(self.model(shape, geometry, layers)[2])


def _build_fused(spec, mspec, model, directory: Path) -> list[dict[str, ModuleLoRA]]:
    """peft's adapter saved to ``directory``; its in-memory factors (in the stored dtype) as expected."""
    from moelora_conformance.fixtures.adapters import lora_config, make_peft_model, save_peft
    from moelora_conformance.hf_check.extract import lora_from_peft
    from moelora_conformance.hf_check.hf_model import decoder_layers

    peft_model = make_peft_model(model, lora_config(spec), spec.seed)
    save_peft(peft_model, directory, base_name=mspec.name, stored_dtype=spec.stored_dtype)
    return [lora_from_peft(layer, intermediate=mspec.inter) for layer in decoder_layers(peft_model)]


def _per_module_reference(directory: Path, mspec) -> list[dict[str, ModuleLoRA]]:
    """A legacy per-expert adapter's modules from its files alone: the factors by their keys, σ by
    the LoRA / rsLoRA formula (module docstring)."""
    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    sigma = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    state = load_file(str(directory / "adapter_model.safetensors"))
    leaves = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    out: list[dict[str, ModuleLoRA]] = []
    for layer in range(mspec.layers):
        mods: dict[str, ModuleLoRA] = {}
        prefix = f"base_model.model.model.layers.{layer}"
        for m, leaf in leaves.items():
            keys = [f"{prefix}.mlp.experts.{e}.{leaf}" for e in range(mspec.experts)]
            if f"{keys[0]}.lora_A.weight" in state:
                A = torch.stack([state[f"{k}.lora_A.weight"].float() for k in keys])
                B = torch.stack([state[f"{k}.lora_B.weight"].float() for k in keys])
                mods[m] = ModuleLoRA(A, B, sigma)
        for m, leaf in _LEAF.items():
            key = f"{prefix}.self_attn.{leaf}"
            if f"{key}.lora_A.weight" in state:
                mods[m] = ModuleLoRA(state[f"{key}.lora_A.weight"].float(), state[f"{key}.lora_B.weight"].float(),
                                     sigma)
        out.append(mods)
    return out
