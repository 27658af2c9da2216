"""The parts of a PEFT ``adapter_config.json`` (peft 0.21) that decide what an adapter targets and
how each module is scaled, with the config-level refusals.

Rank and σ per module follow PEFT exactly (``moelora_core.AdapterConfig``): a ``rank_pattern`` /
``alpha_pattern`` key applies to a module whose path ends with it on a dot boundary, the first
matching key wins. The path PEFT matches is the module's path in the transformers model:

- dense projections: ``model.layers.{l}.self_attn.q_proj``;
- ``target_parameters`` (fused experts): the *parameter's* path,
  ``model.layers.{l}.mlp.experts.gate_up_proj`` and ``model.layers.{l}.mlp.experts.down_proj``, so
  gate_up and down can get separate patterns, and a key such as ``mlp.experts`` matches neither;
- legacy per-expert modules: ``model.layers.{l}.mlp.experts.{e}.gate_proj`` (Mixtral:
  ``block_sparse_moe.experts.{e}.w1``).

The fields that decide which modules peft wraps (``target_modules``, ``exclude_modules``,
``layers_to_transform``, ``layers_pattern``, ``target_parameters``) are kept, type-checked, for
:mod:`.peft_targets`.

``target_parameters`` entries follow peft 0.21.2's rule (``BaseTuner._inject_parameters``): an entry
names every parameter whose path *equals* it or *ends with* ``"." + entry``. peft writes the short
names itself: ``LoraConfig(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])`` on a
Qwen3-MoE / OLMoE / Mixtral (``w1``/``w2``/``w3``) model is saved as ``target_modules: ["q_proj"]``,
``target_parameters: ["gate_up_proj", "down_proj"]`` and, for the fused gate_up of rank 2r, α 2α,
``rank_pattern`` / ``alpha_pattern`` keys ``".*\\.gate_up_proj"``. So ``gate_up_proj``,
``experts.gate_up_proj``, ``mlp.experts.gate_up_proj`` and ``model.layers.0.mlp.experts.gate_up_proj``
are all served (:func:`expert_parameter`); an entry naming any other parameter (the router's
``gate.weight``, which peft's ``"all-linear"`` adds on transformers 5 MoE models; an expert bias) is
refused with the rule it breaks. The adapter reader applies the same rule (:meth:`PeftAdapterConfig.
targets_parameter`) to decide which parameter each fused wrapper holds.

A list-form ``target_modules`` entry naming another family's expert projections (``w1`` on a
Qwen3-MoE, ``gate_proj`` on a Mixtral) matches no module of the model: peft wraps nothing for it and
applies the rest of the file, so moelora serves the rest too and says so in
:attr:`PeftAdapterConfig.notes` (a file that holds such *keys* is still refused, by the key reader).

A field of the wrong JSON type is refused by name (``target_modules: [1, 2]``, a string
``target_parameters``) rather than iterated character by character; a single string
``modules_to_save`` is read as one module name, since any ``modules_to_save`` is refused anyway and
the refusal should name the module (``"lm_head"`` → :class:`VocabularyTargetError`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moelora_core.adapter_config import AdapterConfig
from moelora_core.checkpoint.errors import (
    AdapterFormatError,
    DoRAError,
    ModelMismatchError,
    UnsupportedTargetError,
    VocabularyTargetError,
)
from moelora_core.errors import InvalidFieldError

#: Module names whose LoRA (or full copy) changes the vocabulary path.
VOCABULARY_MODULES: frozenset[str] = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings"})
#: Fields of adapter_config.json that switch on a LoRA variant moelora does not serve.
_VARIANT_FIELDS: tuple[str, ...] = (
    "use_qalora", "use_bdlora", "alora_invocation_tokens", "arrow_config", "velora_config", "kasa_config",
    "monteclora_config",
)
#: The expert parameters moelora applies LoRA to through ``target_parameters``.
EXPERT_PARAMETERS: tuple[str, str] = ("gate_up_proj", "down_proj")
#: A list index as torch names it (ASCII digits, no leading zero).
_INDEX = re.compile(r"0|[1-9][0-9]*")


def expert_parameter(entry: str, blocks: tuple[str, ...] = ("mlp",)) -> str | None:
    """The expert parameter (``"gate_up_proj"`` / ``"down_proj"``) a ``target_parameters`` entry names
    by peft's rule, or None.

    peft wraps every parameter whose path equals the entry or ends with ``"." + entry``; the expert
    parameters' paths are ``model.layers.<L>.<block>.experts.<param>``, so the entry must be that path
    or one of its dot-boundary tails (``gate_up_proj``, ``experts.gate_up_proj``,
    ``mlp.experts.gate_up_proj``, ``layers.0.mlp.experts.gate_up_proj``, ...).

    Args:
        entry: one ``target_parameters`` entry as written.
        blocks: the MoE block names of the family (``Family.expert_blocks``).
    """
    parts = entry.split(".")
    if parts[-1] not in EXPERT_PARAMETERS or len(parts) > 6:
        return None
    template = ("model", "layers", None, "block", "experts")
    for part, want in zip(parts[-2::-1], template[::-1]):
        if want is None:
            if not _INDEX.fullmatch(part):
                return None
        elif want == "block":
            if part not in blocks:
                return None
        elif part != want:
            return None
    return parts[-1]


@dataclass(frozen=True)
class PeftAdapterConfig:
    """A LoRA adapter's config, validated.

    Attributes:
        name: the adapter's name (for messages).
        lora: r, α, rsLoRA and the patterns (``AdapterConfig``).
        target_modules: as written (a list of names, a regex string, or None).
        target_parameters: parameter paths or suffixes (``mlp.experts.gate_up_proj``), may be empty.
        base_model_class: ``auto_mapping.base_model_class`` when PEFT recorded it.
        raw: the whole JSON object.
        exclude_modules: names (list) or a regex string of modules peft must not wrap, or None.
        layers_to_transform: the layer index (int) or indices peft restricts list-form
            ``target_modules`` to, or None (every layer).
        layers_pattern: names of the module list holding the layers (``"layers"``), or None.
        notes: what the reader served differently from what the config seems to ask, one sentence
            each (target_modules entries that match no module of the model); shown as warnings.
    """

    name: str
    lora: AdapterConfig
    target_modules: tuple[str, ...] | str | None
    target_parameters: tuple[str, ...]
    base_model_class: str | None
    raw: Mapping[str, object]
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | int | None = None
    layers_pattern: tuple[str, ...] | None = None
    notes: tuple[str, ...] = ()

    def targets_parameter(self, param_path: str) -> bool:
        """Whether ``target_parameters`` names ``param_path`` (PEFT's rule: equal, or ends with
        ``"." + target``)."""
        return any(param_path == t or param_path.endswith(f".{t}") for t in self.target_parameters)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _names_or_regex(raw: Mapping[str, object], field: str, name: str) -> tuple[str, ...] | str | None:
    """A ``target_modules`` / ``exclude_modules`` value: None, a list of names, or one regex string."""
    value = raw.get(field)
    where = f"adapter_config.json {field}"
    if value is None:
        return None
    if isinstance(value, str):
        if value.lower() != "all-linear":
            try:
                re.compile(value)
            except re.error as exc:
                raise AdapterFormatError(name, where, f"not a valid regular expression: {exc}",
                                         found=repr(value)) from None
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterFormatError(name, where, "must be a list of module names or one regular-expression string",
                             found=repr(value))


def _name_list(raw: Mapping[str, object], field: str, name: str) -> tuple[str, ...]:
    """A list-of-names field (``target_parameters``): None or a list of strings, nothing else."""
    value = raw.get(field)
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterFormatError(name, f"adapter_config.json {field}", "must be a list of names (a string is not a list)",
                             found=repr(value))


def _layer_filter(raw: Mapping[str, object], name: str) -> tuple[tuple[int, ...] | int | None, tuple[str, ...] | None]:
    """``layers_to_transform`` (None, an int or a list of ints) and ``layers_pattern`` (None, a
    string or a list of strings)."""
    indexes = raw.get("layers_to_transform")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (indexes is None or is_int(indexes) or (isinstance(indexes, list) and all(is_int(v) for v in indexes))):
        raise AdapterFormatError(name, "adapter_config.json layers_to_transform",
                                 "must be a layer index or a list of layer indices", found=repr(indexes))
    pattern = raw.get("layers_pattern")
    if isinstance(pattern, str):
        pattern = [pattern]
    if not (pattern is None or (isinstance(pattern, list) and all(isinstance(v, str) for v in pattern))):
        raise AdapterFormatError(name, "adapter_config.json layers_pattern",
                                 "must be a name or a list of names of the layer list", found=repr(pattern))
    return (tuple(indexes) if isinstance(indexes, list) else indexes), (tuple(pattern) if pattern else None)


def parse_adapter_config(
    raw: Mapping[str, object],
    *,
    name: str,
    supported_leaves: frozenset[str],
    foreign_leaves: frozenset[str] = frozenset(),
    architecture: str | None = None,
    expert_blocks: tuple[str, ...] = ("mlp",),
    family: str = "this",
) -> PeftAdapterConfig:
    """Validate an ``adapter_config.json`` object and apply the config-level refusals.

    Args:
        raw: the parsed JSON.
        name: the adapter's name, for messages.
        supported_leaves: module leaf names a list-form ``target_modules`` may hold (the model's
            attention projections and its family's per-expert projections).
        foreign_leaves: leaf names that only another model family has (Mixtral's ``w1`` for a
            Qwen3-MoE model): they match no module of the model, so peft wraps nothing for them;
            served without them, named in ``notes`` (keys of such modules are refused by the key reader).
        expert_blocks: the family's MoE block names (``Family.expert_blocks``) for
            :func:`expert_parameter`.
        family: the family's display name, for the notes.
        architecture: the model's ``*ForCausalLM`` class; an adapter whose recorded
            ``auto_mapping.base_model_class`` differs was made for another model.

    Raises:
        AdapterFormatError: not LoRA; malformed r / α / patterns; a target field of the wrong type
            or an invalid regular expression; lora bias, fan_in_fan_out, or a LoRA variant.
        ModelMismatchError: made for another architecture.
        DoRAError: ``use_dora``.
        VocabularyTargetError: ``trainable_token_indices``, or embedding / LM-head targets or
            ``modules_to_save``.
        UnsupportedTargetError: other ``modules_to_save``; a list-form target that is not an
            attention projection or an expert projection; a ``target_parameters`` entry that names
            no expert parameter by peft's rule (:func:`expert_parameter`), e.g. the router's ``gate.weight``.
    """
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise AdapterFormatError(name, "adapter_config.json peft_type", "not a LoRA adapter",
                                 expected="'LORA'", found=repr(peft_type))
    auto = raw.get("auto_mapping")
    base_class = auto.get("base_model_class") if isinstance(auto, Mapping) else None
    if base_class and architecture and base_class != architecture:
        raise ModelMismatchError(name, "adapter_config.json auto_mapping.base_model_class",
                                 "the adapter was made for another model", expected=architecture, found=base_class)
    targets = _names_or_regex(raw, "target_modules", name)
    exclude = _names_or_regex(raw, "exclude_modules", name)
    params = _name_list(raw, "target_parameters", name)
    layers_to_transform, layers_pattern = _layer_filter(raw, name)
    leaves = [_leaf(t) for t in targets] if isinstance(targets, tuple) else []
    foreign = sorted({t for t in leaves if t in foreign_leaves})
    notes = []
    if foreign:
        notes.append(f"target_modules {foreign} name another model family's expert projections and match no module "
                     f"of {family} model; peft wraps nothing for them, so they add nothing (served without them)")
        leaves = [t for t in leaves if t not in foreign_leaves]
    if raw.get("use_dora"):
        raise DoRAError(name, "adapter_config.json use_dora", "DoRA adapters are not supported", found=True)
    if raw.get("trainable_token_indices"):
        raise VocabularyTargetError(
            name, "adapter_config.json trainable_token_indices", "the adapter trains token embeddings "
            "(added or re-trained tokens)", found=raw["trainable_token_indices"],
        )
    saved_raw = raw.get("modules_to_save") or []
    saved_raw = [saved_raw] if isinstance(saved_raw, str) else saved_raw
    if not isinstance(saved_raw, list):
        raise AdapterFormatError(name, "adapter_config.json modules_to_save", "must be a list of module names",
                                 found=repr(saved_raw))
    saved = [str(m) for m in saved_raw]
    vocab = sorted({t for t in leaves + [_leaf(m) for m in saved] if t in VOCABULARY_MODULES})
    if vocab:
        raise VocabularyTargetError(name, "adapter_config.json target_modules/modules_to_save",
                                    "the adapter targets the embedding or the LM head", found=vocab)
    if saved:
        raise UnsupportedTargetError(name, "adapter_config.json modules_to_save",
                                     "full copies of modules are not served", found=saved)
    for field in ("lora_bias", "fan_in_fan_out"):
        if raw.get(field):
            raise AdapterFormatError(name, f"adapter_config.json {field}", "not supported", expected=False, found=True)
    for field in _VARIANT_FIELDS:
        if raw.get(field):
            raise AdapterFormatError(name, f"adapter_config.json {field}", "LoRA variant not supported",
                                     found=raw[field])
    unsupported = sorted({t for t in leaves if t not in supported_leaves})
    if unsupported:
        why = ("LoRA on the shared expert's sigmoid gate (mlp.shared_expert_gate) is not served (peft's 'all-linear' "
               "targets it on Qwen2-MoE: list the targets instead); " if "shared_expert_gate" in unsupported else "")
        raise UnsupportedTargetError(name, "adapter_config.json target_modules", f"{why}targets moelora does not serve",
                                     expected=f"a subset of {sorted(supported_leaves)}", found=unsupported)
    bad_params = [p for p in params if expert_parameter(p, expert_blocks) is None]
    if bad_params:
        router = [p for p in bad_params if _leaf(p) in ("weight", "bias") and p.split(".")[-2:-1] in (["gate"],
                                                                                                   ["router"])]
        why = ("LoRA on the router is not served (peft's 'all-linear' adds the router's gate.weight on transformers 5 "
               "MoE models: list the targets instead, e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', "
               "'gate_proj', 'up_proj', 'down_proj']); " if router else "")
        raise UnsupportedTargetError(
            name, "adapter_config.json target_parameters",
            f"{why}each entry must name an expert parameter by peft's rule: equal to, or a dot-boundary tail of, "
            f"model.layers.L.{expert_blocks[-1]}.experts.gate_up_proj / .down_proj",
            expected="e.g. 'gate_up_proj', 'experts.down_proj', 'mlp.experts.gate_up_proj'", found=bad_params)
    try:
        lora = AdapterConfig(
            r=raw.get("r"),
            lora_alpha=raw.get("lora_alpha", 8),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        )
    except (InvalidFieldError, TypeError, ValueError) as exc:
        raise AdapterFormatError(name, "adapter_config.json", f"invalid LoRA settings: {exc}") from None
    return PeftAdapterConfig(
        name=name,
        lora=lora,
        target_modules=targets,
        target_parameters=params,
        base_model_class=str(base_class) if base_class else None,
        raw=dict(raw),
        exclude_modules=exclude,
        layers_to_transform=layers_to_transform,
        layers_pattern=layers_pattern,
        notes=tuple(notes),
    )


def read_adapter_config(directory: Path, *, name: str, **checks: object) -> PeftAdapterConfig:
    """Read and validate ``directory/adapter_config.json``; ``checks`` are the keyword arguments of
    :func:`parse_adapter_config` (supported_leaves, foreign_leaves, architecture, expert_blocks, family).

    Also refuses an adapter shipped with ``added_tokens.json`` (its tokenizer grew the vocabulary).

    Raises:
        AdapterFormatError: the file is missing or not a JSON object; plus every refusal of
            :func:`parse_adapter_config`.
        VocabularyTargetError: a non-empty ``added_tokens.json``.
    """
    file = directory / "adapter_config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterFormatError(name, "adapter_config.json", f"not found in {directory}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(name, "adapter_config.json", f"not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(name, "adapter_config.json", "must hold a JSON object")
    added = directory / "added_tokens.json"
    if added.is_file():
        try:
            tokens = json.loads(added.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            tokens = {"<unreadable>": None}
        if tokens:
            raise VocabularyTargetError(name, "added_tokens.json", "the adapter adds tokens to the vocabulary",
                                        found=sorted(tokens)[:5])
    return parse_adapter_config(raw, name=name, **checks)
