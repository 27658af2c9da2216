"""Classify the keys of a PEFT ``adapter_model.safetensors`` against a model (peft 0.21 names).

Every key starts with ``base_model.model.``; what follows is a module path of the transformers
model and the factor. The forms moelora reads (l = layer, e = expert):

=========================================================  =========================================
key (after ``base_model.model.``)                          meaning
=========================================================  =========================================
model.layers.l.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight  dense LoRA: A [r, in], B [out, r]
model.layers.l.mlp.experts.base_layer.lora_{A,B}.weight    fused ``target_parameters``, inner
                                                           ParamWrapper (gate_up when both targeted)
model.layers.l.mlp.experts.lora_{A,B}.weight               fused, outer ParamWrapper (down when both
                                                           targeted; else the one targeted)
model.layers.l.mlp.experts.e.{gate,up,down}_proj.lora_..   legacy per-expert (Mixtral:
model.layers.l.block_sparse_moe.experts.e.{w1,w3,w2}.lora  ``block_sparse_moe``, w1/w3/w2)
=========================================================  =========================================

Everything else is refused, by kind (the first non-empty kind in this order wins, listing up to 5
keys): a LoRA bias (format), DoRA magnitudes, vocabulary keys (embedding / LM head / trainable
tokens), real modules of the model that moelora does not serve (router, norms, ...), keys made for
another model (another family's expert names, a layer or expert index past the model's), and keys
that match no module at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moelora_core.checkpoint.errors import (
    AdapterFormatError,
    AdapterRefusal,
    DoRAError,
    ModelMismatchError,
    UnmatchedKeysError,
    UnsupportedTargetError,
    VocabularyTargetError,
)
from moelora_core.checkpoint.families import ALL_EXPERT_LEAVES, FAMILIES
from moelora_core.checkpoint.model_config import MoEModelConfig
from moelora_core.checkpoint.peft_config import VOCABULARY_MODULES

PREFIX = "base_model.model."
_WRAPPER_PARTS = ("base_layer", "modules_to_save", "original_module", "token_adapter")


@dataclass(frozen=True)
class LoraKey:
    """One LoRA factor key of the adapter, understood.

    Attributes:
        key: the key as stored.
        layer: decoder layer index.
        kind: "dense", "fused" or "expert".
        target: dense: "q"/"k"/"v"/"o"; fused: "outer"/"inner" (ParamWrapper nesting); expert:
            "gate"/"up"/"down".
        factor: "A" or "B".
        block: the MoE block name in the key ("mlp", "block_sparse_moe"); "" for dense.
        expert: expert index for "expert" keys, else None.
        module_path: PEFT's module path (``model.layers.0.self_attn.q_proj``,
            ``model.layers.0.mlp.experts``, ``model.layers.0.mlp.experts.3.gate_proj``).
    """

    key: str
    layer: int
    kind: str
    target: str
    factor: str
    block: str
    expert: int | None
    module_path: str


def _alt(names) -> str:
    return "|".join(re.escape(n) for n in sorted(names))


def _module_path(rest: str) -> str:
    """The model module a key belongs to: the path before its first LoRA / wrapper component."""
    parts = rest.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") or part in _WRAPPER_PARTS or part == "trainable_tokens_delta":
            return ".".join(parts[:i])
    return ".".join(parts[:-1])  # a plain parameter: its owner


def _model_modules(model: MoEModelConfig) -> set[str]:
    """Module paths of the transformers model (per-expert and fused names alike)."""
    fam = model.family
    mods = {"model", "model.embed_tokens", "model.norm", "lm_head", "model.layers", "model.rotary_emb"}
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}"
        mods |= {p, f"{p}.self_attn", f"{p}.input_layernorm", f"{p}.post_attention_layernorm"}
        mods |= {f"{p}.self_attn.{leaf}" for leaf in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if fam.qk_norm:
            mods |= {f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"}
        for block in fam.expert_blocks:
            mods |= {f"{p}.{block}", f"{p}.{block}.gate", f"{p}.{block}.experts"}
            for e in range(model.num_experts):
                mods |= {f"{p}.{block}.experts.{e}"}
                mods |= {f"{p}.{block}.experts.{e}.{leaf}" for leaf in fam.expert_leaves}
    return mods


def classify_keys(keys: list[str], model: MoEModelConfig, adapter: str) -> list[LoraKey]:
    """Understand every key or refuse the adapter.

    Args:
        keys: the adapter's tensor keys.
        model: the model the adapter is read for.
        adapter: the adapter's name, for messages.

    Returns:
        One :class:`LoraKey` per key, in key order.

    Raises:
        AdapterFormatError: a LoRA bias (``lora_B.bias``).
        DoRAError: ``lora_magnitude_vector`` keys.
        VocabularyTargetError: embedding / LM-head / trainable-token keys.
        UnsupportedTargetError: LoRA on a real module moelora does not serve (router, norms, ...).
        ModelMismatchError: another family's expert names, or a layer / expert index past the
            model's.
        UnmatchedKeysError: keys that name no module of the model.
    """
    fam = model.family
    blocks, leaves = _alt(fam.expert_blocks), _alt(fam.expert_leaves)
    dense_re = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.lora_([AB])\.weight")
    fused_re = re.compile(rf"model\.layers\.(\d+)\.({blocks})\.experts\.(base_layer\.)?lora_([AB])\.weight")
    expert_re = re.compile(rf"model\.layers\.(\d+)\.({blocks})\.experts\.(\d+)\.({leaves})\.lora_([AB])\.weight")
    foreign_blocks = {b for f in FAMILIES.values() for b in f.expert_blocks} - set(fam.expert_blocks)
    foreign_leaves = ALL_EXPERT_LEAVES - set(fam.expert_leaves)
    foreign_forms = []
    if foreign_blocks:
        foreign_forms.append(rf"(?:{_alt(foreign_blocks)})\.")
    if foreign_leaves:
        foreign_forms.append(rf"[^.]+\.experts\.\d+\.(?:{_alt(foreign_leaves)})\.")
    foreign_re = re.compile(rf"model\.layers\.\d+\.(?:{'|'.join(foreign_forms)})") if foreign_forms else None
    known = _model_modules(model)

    found: list[LoraKey] = []
    refused: dict[type[AdapterRefusal], list[str]] = {}

    def refuse(kind: type[AdapterRefusal], key: str) -> None:
        refused.setdefault(kind, []).append(key)

    for key in keys:
        if not key.startswith(PREFIX):
            refuse(UnmatchedKeysError, key)
            continue
        rest = key[len(PREFIX):]
        parts = rest.split(".")
        if "lora_magnitude_vector" in parts:
            refuse(DoRAError, key)
            continue
        if (any(p in VOCABULARY_MODULES for p in parts) or any(p.startswith("lora_embedding_") for p in parts)
                or "trainable_tokens_delta" in parts):
            refuse(VocabularyTargetError, key)
            continue
        if m := dense_re.fullmatch(rest):
            layer, target, factor = int(m[1]), m[2], m[3]
            path = f"model.layers.{layer}.self_attn.{target}_proj"
            rec = LoraKey(key, layer, "dense", target, factor, "", None, path)
        elif m := fused_re.fullmatch(rest):
            layer, block = int(m[1]), m[2]
            rec = LoraKey(key, layer, "fused", "inner" if m[3] else "outer", m[4], block, None,
                          f"model.layers.{layer}.{block}.experts")
        elif m := expert_re.fullmatch(rest):
            layer, block, expert, leaf = int(m[1]), m[2], int(m[3]), m[4]
            rec = LoraKey(key, layer, "expert", fam.expert_module(leaf), m[5], block, expert,
                          f"model.layers.{layer}.{block}.experts.{expert}.{leaf}")
        else:
            if rest.endswith(".lora_B.bias"):
                refuse(AdapterFormatError, key)
            elif foreign_re is not None and foreign_re.match(rest):
                refuse(ModelMismatchError, key)
            elif _module_path(rest) in known:
                refuse(UnsupportedTargetError, key)
            elif (m := re.match(r"model\.layers\.(\d+)\.", rest)) and int(m[1]) >= model.num_layers:
                refuse(ModelMismatchError, key)
            else:
                refuse(UnmatchedKeysError, key)
            continue
        if rec.layer >= model.num_layers or (rec.expert is not None and rec.expert >= model.num_experts):
            refuse(ModelMismatchError, key)
            continue
        found.append(rec)

    problems = {
        AdapterFormatError: "LoRA bias is not supported",
        DoRAError: "DoRA magnitude vectors are not supported",
        VocabularyTargetError: "the adapter changes the embedding / LM head / token vocabulary",
        UnsupportedTargetError: "LoRA on modules moelora does not serve (router, norms, ...)",
        ModelMismatchError: f"keys made for another model (this is a {model.num_layers}-layer, "
                            f"{model.num_experts}-expert {fam.display} model)",
        UnmatchedKeysError: "keys that match no module of the model",
    }
    for kind, problem in problems.items():
        if kind in refused:
            bad = refused[kind]
            shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
            raise kind(adapter, shown, f"{len(bad)} key(s): {problem}")
    return found
