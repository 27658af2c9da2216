"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into
per-layer, per-module ``ModuleLoRA`` factors ready for ``LoRAWeights.load_slot``.

Formats (peft 0.21.2, transformers 5.17):

- **fused** ``target_parameters`` on ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``:
  lora_A ``[E·r, in]`` is expert-major (``reshape(E, r, in)``); lora_B ``[out, r·E]`` is rank-major,
  expert-minor (``reshape(out, r, E)``; see ``ParamWrapper.get_delta_weight``). gate_up's out is
  2I with gate rows first, and gate and up share one A: ``A_gate = A_up = A_e``,
  ``B_gate = B_e[:I]``, ``B_up = B_e[I:]`` (GPT-OSS, interleaved: ``B_e[0::2]`` / ``B_e[1::2]``).
  With both parameters targeted the inner wrapper
  (``experts.base_layer``) is gate_up and the outer one (bare ``experts``) is down, whatever order the
  config lists them in (PEFT wraps parameters in the order the experts module registers them,
  ``gate_up_proj`` first); with one targeted, bare ``experts`` is that one.
- **3-D expert tensors** (SGLang's MoE-LoRA contract, Megatron-Bridge / Miles / SkyRL / NeMo RL
  exports): ``mlp.experts.gate_up_proj.lora_A.weight`` ``[E_A, r, H]``, ``...lora_B.weight``
  ``[E_B, 2I, r]`` (gate rows first), ``mlp.experts.down_proj.lora_A.weight`` ``[E_A, r, I]``,
  ``...lora_B.weight`` ``[E_B, H, r]``; the config targets them through ``target_parameters`` or
  ``target_modules``. peft cannot load these.
- **Expert layouts** (:mod:`.expert_layout`): in both the 3-D and the 2-D fused encodings a factor
  may have expert count 1, shared by every expert: shared-outer (gate_up A and down B) or fully
  shared (all four). The layout is read from the factors' expert counts, never from hidden or
  intermediate sizes; shared factors are returned as ``[1, r, in]`` / ``[1, out, r]`` (stored once
  per slot by a pool whose ``expert_layout`` shares them). A file mixing encodings, sharing a factor
  on some layers only, or sharing the wrong side is refused (``ExpertLayoutError``).
- **per-expert** (legacy, transformers v4 module names): ``mlp.experts.{e}.gate_proj/up_proj/
  down_proj`` (Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``), each with its own A and B, rank
  and σ; a module (or an expert) absent from the file is zeros. peft 0.21.2 converts these on load
  to a fused adapter of rank 2r and α 2α, which changes σ under rsLoRA; moelora follows the file's
  own modules (DESIGN.md §1), so σ here is the per-module one.
- **dense** ``self_attn.{q,k,v,o}_proj``: A ``[r, in]``, B ``[out, r]``; likewise Qwen2-MoE's shared
  expert ``mlp.shared_expert.{gate,up,down}_proj`` (modules ``shared_gate``, ``shared_up``,
  ``shared_down``: in/out H → Is, H → Is, Is → H), which peft wraps as plain ``nn.Linear`` modules
  through ``target_modules``.

σ = α/r or α/√r (rsLoRA) with the module's r and α from ``rank_pattern`` / ``alpha_pattern``
(``moelora_core.AdapterConfig``, PEFT's matching; see :mod:`.peft_config` for the paths matched).
σ is returned apart, never folded into B. Weights stored in fp32, fp16 or bf16 are cast to the
compute dtype.

Only modules the config targets are read: keys of modules peft would not wrap (``target_modules``,
``exclude_modules``, ``layers_to_transform``; see :mod:`.peft_targets`) are refused, not served.

Everything is validated (config, keys, targets, shapes, ranks, finiteness before and after the
cast) before anything is returned; refusals are the classes of :mod:`.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moelora_core.adapter_config import AdapterConfig
from moelora_core.checkpoint.adapter_keys import LoraKey, classify_keys
from moelora_core.checkpoint.errors import (
    AdapterFormatError,
    ExpertLayoutError,
    ModelMismatchError,
    NonFiniteWeightError,
    RankTooLargeError,
    ShapeMismatchError,
)
from moelora_core.checkpoint.expert_layout import StageCounts, detect_expert_layout, expert_count
from moelora_core.checkpoint.families import ALL_EXPERT_LEAVES
from moelora_core.checkpoint.model_config import MoEModelConfig
from moelora_core.checkpoint.peft_config import PeftAdapterConfig, read_adapter_config
from moelora_core.checkpoint.peft_targets import refuse_untargeted, targets_module
from moelora_core.checkpoint.tensor_source import TensorSource
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import ALL_MODULES, SUPPORTED_DTYPES
from moelora_core.weights import ModuleLoRA

_FLOATS = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter, read for one model: per layer, module name → ``ModuleLoRA``.

    Attributes:
        name: the adapter's name.
        path: its directory.
        model_type: the family it was read for.
        formats: the expert formats found ("fused", "packed" for 3-D expert tensors, "per_expert";
            empty for attention-only).
        config: the validated adapter config.
        layers: ``layers[l]`` maps "gate", "up", "down" (A [E, r, in], B [E, out, r]; expert dim 1
            for a factor shared by all experts, see ``expert_layout``) and "q", "k",
            "v", "o", "shared_gate", "shared_up", "shared_down" (A [r, in], B [out, r]) to factors in
            ``dtype``; a module absent from layer l is absent from the mapping (it adds nothing).
        dtype: the compute dtype the factors were cast to.
        stored_dtypes: the dtypes found in the file.
        expert_layout: "per_expert", "shared_outer" or "fully_shared" (``EXPERT_LAYOUTS``), read
            from the factors' expert counts; "per_expert" for an adapter without expert factors.
    """

    name: str
    path: str
    model_type: str
    formats: tuple[str, ...]
    config: PeftAdapterConfig
    layers: tuple[Mapping[str, ModuleLoRA], ...]
    dtype: torch.dtype
    stored_dtypes: tuple[str, ...] = field(default=())
    expert_layout: str = "per_expert"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def modules(self) -> tuple[str, ...]:
        """Modules present in at least one layer, in ``ALL_MODULES`` order."""
        return tuple(m for m in ALL_MODULES if any(m in layer for layer in self.layers))

    def max_rank(self) -> int:
        """The largest module rank (what the pool's R must hold)."""
        return max((lora.rank for layer in self.layers for lora in layer.values()), default=0)

    def scaling(self) -> float:
        """The adapter-level σ: that of the first module in ``ALL_MODULES`` order, first layer."""
        for module in ALL_MODULES:
            for layer in self.layers:
                if module in layer:
                    return float(layer[module].scaling)
        return 0.0


@dataclass
class _Plan:
    """One module (or fused pair) of one layer before its tensors are read."""

    layer: int
    kind: str  # "dense" | "gate_up" | "down" | "expert"
    module: str  # dense/expert module name; "gate_up" / "down" for fused
    path: str  # PEFT path matched by the patterns
    a_keys: dict[int | None, str] = field(default_factory=dict)  # expert (None = whole) → key
    b_keys: dict[int | None, str] = field(default_factory=dict)
    ranks: dict[int | None, int] = field(default_factory=dict)
    scalings: dict[int | None, float] = field(default_factory=dict)
    experts: dict[str, int] = field(default_factory=dict)  # gate_up / down: factor → expert count (1 or E)
    encoding: str = ""  # gate_up / down: "fused" (PEFT 2-D) | "packed" (3-D)

    def describe(self) -> str:
        return f"layer {self.layer} {self.module} ({self.path})"


def _pairs(keys: list[LoraKey], name: str) -> dict[tuple, dict[str, LoraKey]]:
    """Group factor keys by their module; each module needs both lora_A and lora_B."""
    groups: dict[tuple, dict[str, LoraKey]] = {}
    for k in keys:
        groups.setdefault((k.layer, k.kind, k.target, k.block, k.expert), {})[k.factor] = k
    for factors in groups.values():
        if len(factors) != 2:
            have = next(iter(factors.values()))
            missing = "lora_B" if "A" in factors else "lora_A"
            raise AdapterFormatError(name, have.key, f"has no partner {missing}")
    return groups


def _resolve_fused(
    layer: int, block: str, wrappers: set[str], cfg: PeftAdapterConfig, name: str
) -> dict[str, str]:
    """ParamWrapper nesting → parameter: {"inner": "gate_up_proj", "outer": "down_proj"} etc."""
    base = f"model.layers.{layer}.{block}.experts"
    targeted = [p for p in ("gate_up_proj", "down_proj") if cfg.targets_parameter(f"{base}.{p}")]
    where = f"{base} (target_parameters={list(cfg.target_parameters)})"
    if len(targeted) == 2:  # peft nests both on every layer: inner gate_up, outer down
        return {"inner": "gate_up_proj", "outer": "down_proj"}
    if "inner" in wrappers:
        raise AdapterFormatError(name, where, "nested expert wrappers (experts.base_layer) need both "
                                 "gate_up_proj and down_proj targeted", found=targeted)
    if len(targeted) != 1:
        raise AdapterFormatError(name, where, "one expert wrapper, but the config does not say which parameter "
                                 "it wraps", expected="exactly one of gate_up_proj / down_proj", found=targeted)
    return {"outer": targeted[0]}


def _rank_and_scaling(lora: AdapterConfig, path: str, plan: _Plan, name: str) -> tuple[int, float]:
    """(rank, σ) of the module at ``path``; a σ the fp32 tables cannot hold (α from ``alpha_pattern``)
    is refused here, at read time, rather than in the middle of a slot load."""
    try:
        return lora.rank_for(path), lora.scaling_for(path)
    except InvalidFieldError as exc:
        raise AdapterFormatError(name, f"layer {plan.layer} {plan.module} ({path})", str(exc)) from None


def _plan(keys: list[LoraKey], cfg: PeftAdapterConfig, model: MoEModelConfig, name: str) -> list[_Plan]:
    groups = _pairs(keys, name)
    lora = cfg.lora
    plans: dict[tuple[int, str], _Plan] = {}
    fused_wrappers: dict[tuple[int, str], set[str]] = {}
    for (layer, kind, target, block, _expert) in groups:
        if kind == "fused":
            fused_wrappers.setdefault((layer, block), set()).add(target)
    expert_layers = {}
    for (layer, kind, _target, _block, _expert) in groups:
        if kind in ("fused", "expert", "packed"):
            expert_layers.setdefault(layer, set()).add(kind)
    encodings = {kind: sorted(layer for layer, kinds in expert_layers.items() if kind in kinds)
                 for kind in ("fused", "expert", "packed")}
    if encodings["packed"] and (encodings["fused"] or encodings["expert"]):
        other = "fused" if encodings["fused"] else "expert"
        raise ExpertLayoutError(name, "expert keys", "mixes two encodings of the expert factors: 3-D "
                                "experts.{gate_up,down}_proj tensors and PEFT's "
                                + ("2-D fused experts.lora_* keys" if other == "fused" else "per-expert keys"),
                                found=f"3-D on layers {encodings['packed'][:4]}, {other} on layers "
                                      f"{encodings[other][:4]}")
    for layer, kinds in expert_layers.items():
        if len(kinds) > 1:
            raise AdapterFormatError(name, f"model.layers.{layer}", "mixes fused and per-expert expert keys")
    resolved = {lb: _resolve_fused(*lb, w, cfg, name) for lb, w in fused_wrappers.items()}

    for (layer, kind, target, block, expert), factors in sorted(groups.items(), key=lambda kv: str(kv[0])):
        a, b = factors["A"].key, factors["B"].key
        if kind == "dense":
            path = factors["A"].module_path
            plan = plans.setdefault((layer, target), _Plan(layer, "dense", target, path))
            plan.a_keys[None], plan.b_keys[None] = a, b
            plan.ranks[None], plan.scalings[None] = _rank_and_scaling(lora, path, plan, name)
        elif kind == "packed":
            path = factors["A"].module_path  # the parameter path, model.layers.L.mlp.experts.gate_up_proj
            if not (cfg.targets_parameter(path) or targets_module(cfg, path)):
                raise AdapterFormatError(name, f"{a}, {b}", "3-D expert keys of a parameter the config does not "
                                         "target", expected=f"target_parameters or target_modules naming {path}",
                                         found=f"target_parameters={list(cfg.target_parameters)}")
            plan = plans.setdefault((layer, target), _Plan(layer, target, target, path, encoding="packed"))
            plan.a_keys[None], plan.b_keys[None] = a, b
            plan.ranks[None], plan.scalings[None] = _rank_and_scaling(lora, path, plan, name)
        elif kind == "fused":
            param = resolved[(layer, block)][target]
            path = f"{factors['A'].module_path}.{param}"
            module = "gate_up" if param == "gate_up_proj" else "down"
            plan = plans.setdefault((layer, module), _Plan(layer, module, module, path, encoding="fused"))
            plan.a_keys[None], plan.b_keys[None] = a, b
            plan.ranks[None], plan.scalings[None] = _rank_and_scaling(lora, path, plan, name)
        else:
            path = factors["A"].module_path
            plan = plans.setdefault((layer, target), _Plan(layer, "expert", target,
                                                          path.replace(f".experts.{expert}.", ".experts.*.")))
            plan.a_keys[expert], plan.b_keys[expert] = a, b
            plan.ranks[expert], plan.scalings[expert] = _rank_and_scaling(lora, path, plan, name)
    for plan in plans.values():
        if plan.kind == "expert" and len(set(plan.scalings.values())) > 1:
            raise AdapterFormatError(name, plan.describe(), "σ differs between experts of one module; moelora keeps "
                                     "one σ per module", found=sorted(set(plan.scalings.values())))
    return sorted(plans.values(), key=lambda p: (p.layer, p.module))


def _expected_shapes(plan: _Plan, model: MoEModelConfig, expert: int | None) -> tuple[tuple, tuple]:
    H, I, E = model.hidden_size, model.moe_intermediate_size, model.num_experts  # noqa: E741
    r = plan.ranks[expert]
    if plan.kind == "dense":
        fin, fout = model.dense_shapes[plan.module]
        return (r, fin), (fout, r)
    if plan.kind in ("gate_up", "down"):
        ea, eb = plan.experts.get("A", E), plan.experts.get("B", E)
        fin, fout = (H, 2 * I) if plan.kind == "gate_up" else (I, H)
        if plan.encoding == "packed":
            return (ea, r, fin), (eb, fout, r)
        return (ea * r, fin), (fout, r * eb)
    fin, fout = (I, H) if plan.module == "down" else (H, I)
    return (r, fin), (fout, r)


def _check_model_dims(plans: list[_Plan], src: TensorSource, model: MoEModelConfig, name: str) -> None:
    """Refuse an adapter whose tensors all agree on a hidden size, expert width or expert count
    other than the model's: it was made for another model (per-key shape errors come later).

    Between the hidden size / expert width and the expert count, the ranks the file shows directly
    (dense and per-expert A ``[r, in]`` with B ``[out, r]``) are compared with the config's: the
    fused factors hold E·r rows, so a config rank other than the file's would otherwise read as
    another expert count.
    """
    hidden, inter, experts, fused_rows = [], [], [], []
    for plan in plans:
        for e in plan.a_keys:
            a, b = src.shape(plan.a_keys[e]), src.shape(plan.b_keys[e])
            if len(a) != 2 or len(b) != 2:
                continue
            if plan.kind == "dense":  # o and the shared expert's down project onto H; the rest read H
                if plan.module in ("q_b", "kv_b"):  # MLA: read the low-rank latents, write per-head widths
                    continue
                hidden.append(b[0] if plan.module in ("o", "shared_down", "dense_down") else a[1])
            elif plan.module in ("gate", "up", "gate_up"):
                hidden.append(a[1])
                inter.append(b[0] // 2 if plan.kind == "gate_up" else b[0])
            else:  # down
                hidden.append(b[0])
                inter.append(a[1])
            # an expert count of 1 is a factor shared by every expert (shared-outer, fully shared),
            # not another model's expert count
            if plan.kind in ("gate_up", "down") and plan.ranks[e] and a[0] % plan.ranks[e] == 0 \
                    and a[0] != plan.ranks[e]:
                experts.append(a[0] // plan.ranks[e])
                fused_rows.append((a[0], plan.ranks[e]))
    for what, found, want in (("hidden size", hidden, model.hidden_size),
                              ("expert intermediate size", inter, model.moe_intermediate_size)):
        if found and len(set(found)) == 1 and found[0] != want:
            raise ModelMismatchError(name, what, "the adapter was made for another model (all its factors agree)",
                                     expected=want, found=found[0])
    confirmed: set[int] = set()  # config ranks the file shows directly
    for plan in plans:
        if plan.kind not in ("dense", "expert"):
            continue
        for e in plan.a_keys:
            a, b = src.shape(plan.a_keys[e]), src.shape(plan.b_keys[e])
            if len(a) == 2 and len(b) == 2 and a[0] == b[1] and a[0] != plan.ranks[e]:
                raise ShapeMismatchError(
                    name, plan.a_keys[e], f"the file's rank differs from the rank the config gives "
                    f"{plan.describe()} (r / rank_pattern)", expected=plan.ranks[e], found=a[0])
            confirmed.add(plan.ranks[e])
    E = model.num_experts
    if experts and len(set(experts)) == 1 and experts[0] != E:
        problem = "the adapter was made for another model (all its factors agree)"
        implied = {rows // E for rows, _ in fused_rows if rows % E == 0}
        fused_ranks = {r for _, r in fused_rows}
        if len(implied) == 1 and all(rows % E == 0 for rows, _ in fused_rows) and not fused_ranks <= confirmed:
            # E·r rows fit the model's E at another rank too, and no other factor shows the
            # config's rank to be the file's: name both readings.
            problem += (f"; or the file's expert rank is {implied.pop()} where the config says "
                        f"{sorted(fused_ranks)} (r / rank_pattern)")
        raise ModelMismatchError(name, "number of experts", problem, expected=E, found=experts[0])


def _read(src: TensorSource, key: str, dtype: torch.dtype, name: str) -> torch.Tensor:
    t = src.get(key)
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        n_nan = int(torch.isnan(t).sum())
        raise NonFiniteWeightError(name, key, f"holds {n_nan} NaN and {int(bad.sum()) - n_nan} Inf value(s)",
                                   expected="finite values", found=f"non-finite at {tuple(bad.nonzero()[0].tolist())}")
    cast = t.to(dtype)
    if not bool(torch.isfinite(cast).all()):
        raise NonFiniteWeightError(name, key, f"overflows {str(dtype).removeprefix('torch.')} when cast "
                                   f"from {str(t.dtype).removeprefix('torch.')}", expected="finite values",
                                   found=f"max |w| = {float(t.abs().max()):.3g}")
    return cast


def _assemble(plan: _Plan, src: TensorSource, model: MoEModelConfig, dtype: torch.dtype,
              name: str) -> dict[str, ModuleLoRA]:
    E, I = model.num_experts, model.moe_intermediate_size  # noqa: E741
    sigma = float(next(iter(plan.scalings.values())))
    if plan.kind == "dense":
        return {plan.module: ModuleLoRA(_read(src, plan.a_keys[None], dtype, name),
                                        _read(src, plan.b_keys[None], dtype, name), sigma)}
    if plan.kind in ("gate_up", "down"):
        r = plan.ranks[None]
        ea, eb = plan.experts["A"], plan.experts["B"]  # 1 = shared by every expert, kept once
        a = _read(src, plan.a_keys[None], dtype, name)
        b = _read(src, plan.b_keys[None], dtype, name)
        if plan.encoding == "packed":  # [E_A, r, in], [E_B, out, r] as stored
            A, B = a.contiguous(), b.contiguous()
        else:  # PEFT 2-D: A [E_A·r, in] expert-major; B [out, r·E_B] rank-major, expert-minor
            A = a.reshape(ea, r, a.shape[1]).contiguous()  # [E_A, r, in]
            B = b.reshape(b.shape[0], r, eb).permute(2, 0, 1).contiguous()  # [E_B, out, r]
        if plan.kind == "down":
            return {"down": ModuleLoRA(A, B, sigma)}
        if model.family.gate_up_layout == "interleaved":  # GPT-OSS: gate column 2i, up 2i + 1
            gate_b, up_b = B[:, 0::2], B[:, 1::2]
        else:
            gate_b, up_b = B[:, :I], B[:, I:]
        return {"gate": ModuleLoRA(A, gate_b.contiguous(), sigma),
                "up": ModuleLoRA(A.clone(), up_b.contiguous(), sigma)}
    r_max = max(plan.ranks.values())
    (_, fin), (fout, _) = _expected_shapes(plan, model, next(iter(plan.ranks)))
    A = torch.zeros(E, r_max, fin, dtype=dtype)  # experts absent from the file stay zero
    B = torch.zeros(E, fout, r_max, dtype=dtype)
    for e in plan.a_keys:
        r = plan.ranks[e]
        A[e, :r] = _read(src, plan.a_keys[e], dtype, name)
        B[e, :, :r] = _read(src, plan.b_keys[e], dtype, name)
    return {plan.module: ModuleLoRA(A, B, sigma)}


def read_adapter(
    path: str | Path,
    model: MoEModelConfig,
    *,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_rank: int | None = None,
) -> AdapterWeights:
    """Read a PEFT LoRA adapter for ``model``.

    Args:
        path: the adapter directory.
        model: the model it is read for (from :func:`read_model_config` / ``MoECheckpoint.config``).
        name: the adapter's name in messages (default: the directory name).
        dtype: compute dtype of the returned factors.
        max_rank: the pool's max rank R; a module of larger rank is refused (None: no limit).

    Returns:
        :class:`AdapterWeights`.

    Raises:
        AdapterFormatError, DoRAError, VocabularyTargetError, UnsupportedTargetError,
        ModelMismatchError, UnmatchedKeysError, ShapeMismatchError, RankTooLargeError,
        NonFiniteWeightError: see :mod:`moelora_core.checkpoint.errors`.
        InvalidFieldError: an unsupported ``dtype`` or a bad ``max_rank``.
    """
    directory = Path(path)
    name = name or directory.name
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidFieldError("dtype", f"must be one of {SUPPORTED_DTYPES}, got {dtype}")
    if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1):
        raise InvalidFieldError("max_rank", f"must be an int >= 1 or None, got {max_rank!r}")
    fam = model.family
    cfg = read_adapter_config(
        directory, name=name,
        supported_leaves=frozenset(fam.attention_leaves().values()) | frozenset(fam.expert_leaves),
        foreign_leaves=ALL_EXPERT_LEAVES - frozenset(fam.expert_leaves),
        architecture=model.architecture,
        expert_blocks=fam.expert_blocks,
        family=f"a {fam.display}",
    )
    src = TensorSource.from_directory(directory, stem="adapter_model",
                                      error=lambda subject, problem: AdapterFormatError(name, subject, problem))
    with src:
        keys = classify_keys(src.keys(), model, name)
        if not keys:
            raise AdapterFormatError(name, "adapter_model.safetensors", "holds no LoRA factor")
        refuse_untargeted(keys, cfg, name)
        for k in keys:
            if src.dtype_name(k.key) not in _FLOATS:
                raise AdapterFormatError(name, k.key, "not a floating-point tensor", found=src.dtype_name(k.key))
        plans = _plan(keys, cfg, model, name)
        _check_model_dims(plans, src, model, name)
        layout = _expert_layout(plans, src, model, name)
        for plan in plans:
            for e in plan.a_keys:
                want_a, want_b = _expected_shapes(plan, model, e)
                for key, want in ((plan.a_keys[e], want_a), (plan.b_keys[e], want_b)):
                    if src.shape(key) != want:
                        raise ShapeMismatchError(
                            name, key, f"wrong shape for {plan.describe()} at rank {plan.ranks[e]}",
                            expected=want, found=src.shape(key))
        if max_rank is not None:
            for plan in plans:
                r = max(plan.ranks.values())
                if r > max_rank:
                    raise RankTooLargeError(name, plan.describe(), "rank above the pool's max rank",
                                            expected=f"<= {max_rank}", found=r)
        layers: list[dict[str, ModuleLoRA]] = [{} for _ in range(model.num_layers)]
        for plan in plans:
            layers[plan.layer].update(_assemble(plan, src, model, dtype, name))
        stored = tuple(sorted({src.dtype_name(k.key) for k in keys}))
    formats = tuple(f for f, found in (("fused", any(p.encoding == "fused" for p in plans)),
                                       ("packed", any(p.encoding == "packed" for p in plans)),
                                       ("per_expert", any(p.kind == "expert" for p in plans))) if found)
    return AdapterWeights(
        name=name, path=str(directory), model_type=model.model_type, formats=formats, config=cfg,
        layers=tuple(layers), dtype=dtype, stored_dtypes=stored, expert_layout=layout,
    )


def _expert_layout(plans: list[_Plan], src: TensorSource, model: MoEModelConfig, name: str) -> str:
    """Set each gate_up / down plan's factor expert counts from the stored shapes and return the
    adapter's one expert layout (:mod:`.expert_layout`; refusals there)."""
    E = model.num_experts
    stages = []
    for plan in plans:
        if plan.kind in ("gate_up", "down"):
            r = plan.ranks[None]
            plan.experts = {f: expert_count(plan.encoding, f, src.shape(keys[None]), r, E)
                            for f, keys in (("A", plan.a_keys), ("B", plan.b_keys))}
            stages.append(StageCounts(plan.layer, plan.kind, plan.experts["A"], plan.experts["B"],
                                      f"{plan.a_keys[None]}, {plan.b_keys[None]}"))
        elif plan.kind == "expert":
            stages.append(StageCounts(plan.layer, "down" if plan.module == "down" else "gate_up", E, E,
                                      plan.describe()))
    return detect_expert_layout(stages, E, name)
