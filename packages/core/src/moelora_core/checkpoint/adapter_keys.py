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
model.layers.l.mlp.experts.{gate_up,down}_proj.lora_{A,B}  3-D expert tensors (SGLang / Megatron-
  .weight                                                  Bridge export): A [E or 1, r, in],
                                                           B [E or 1, out, r]
model.layers.l.mlp.experts.e.{gate,up,down}_proj.lora_..   legacy per-expert (Mixtral:
model.layers.l.block_sparse_moe.experts.e.{w1,w3,w2}.lora  ``block_sparse_moe``, w1/w3/w2)
model.layers.l.mlp.shared_expert.{gate,up,down}_proj.lora  Qwen2-MoE shared expert: dense LoRA on
  _{A,B}.weight                                            modules shared_gate / shared_up /
                                                           shared_down, A [r, in], B [out, r]
=========================================================  =========================================

DeepSeek-V3 (DESIGN.md §1): ``self_attn.{q_proj | q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
o_proj}`` (dense modules q, q_a, q_b, kv_a, kv_b, o), the ungated shared experts
``mlp.shared_experts.{gate,up,down}_proj`` (shared_gate / shared_up / shared_down) on the MoE layers
and the dense MLP ``mlp.{gate,up,down}_proj`` (dense_gate / dense_up / dense_down) on layers
``l < first_k_dense_replace``; expert keys on a dense layer, or dense-MLP keys on an MoE layer, name
no module of the model (``UnmatchedKeysError``).

LoRA on Qwen2-MoE's sigmoid gate ``mlp.shared_expert_gate`` is a real module moelora does not serve
(``UnsupportedTargetError``).

Everything else is refused, by kind (the first non-empty kind in this order wins, listing up to 5
keys): a non-canonical index (``layers.00``, non-ASCII digits; see :mod:`.key_names`), an adapter
name inside the key (``lora_A.default.weight``), a LoRA bias (all three format errors), DoRA
magnitudes, vocabulary keys (embedding / LM head / trainable tokens), real modules of the model that
moelora does not serve (router, norms, ...), keys made for another model (another family's expert
names, a layer or expert index past the model's), and keys that match no module at all.

``lora_A.default.weight`` is what a model's ``state_dict()`` holds; ``save_pretrained`` strips the
adapter name. peft 0.21.2 passes unknown keys through unchanged when it loads, so such a file
loads only under the adapter name ``default`` and is dropped without a warning under any other:
its meaning depends on how it is loaded, and it is refused with that reason.
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
from moelora_core.checkpoint.families import (
    ALL_EXPERT_LEAVES,
    DENSE_MLP_LEAVES,
    FAMILIES,
    SHARED_EXPERT_BLOCK,
    SHARED_EXPERT_GATE,
    SHARED_EXPERT_LEAVES,
)
from moelora_core.checkpoint.key_names import canonical_key, describe_non_canonical
from moelora_core.checkpoint.model_config import MoEModelConfig
from moelora_core.checkpoint.peft_config import VOCABULARY_MODULES

PREFIX = "base_model.model."
_WRAPPER_PARTS = ("base_layer", "modules_to_save", "original_module", "token_adapter")
#: A list index as torch names it: ASCII digits, no leading zero (``\d`` would match any script).
_IDX = r"(0|[1-9][0-9]*)"
#: ``lora_A.<adapter name>.weight``: the in-memory name of a factor, not the saved one.
_NAMED_FACTOR = re.compile(r"\.(?:lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)\.([^.]+)\.(?:weight|bias)$")


@dataclass(frozen=True)
class LoraKey:
    """One LoRA factor key of the adapter, understood.

    Attributes:
        key: the key as stored.
        layer: decoder layer index.
        kind: "dense", "fused", "packed" (3-D expert tensors) or "expert".
        target: dense: "q"/"k"/"v"/"o" or "shared_gate"/"shared_up"/"shared_down" (DeepSeek-V3 also
            "q_a"/"q_b"/"kv_a"/"kv_b" and "dense_gate"/"dense_up"/"dense_down"); fused:
            "outer"/"inner" (ParamWrapper nesting); packed: "gate_up"/"down"; expert:
            "gate"/"up"/"down".
        factor: "A" or "B".
        block: the MoE block name in the key ("mlp", "block_sparse_moe"); "" for dense.
        expert: expert index for "expert" keys, else None.
        module_path: PEFT's module path (``model.layers.0.self_attn.q_proj``,
            ``model.layers.0.mlp.experts``, ``model.layers.0.mlp.experts.3.gate_proj``; packed: the
            parameter path ``model.layers.0.mlp.experts.gate_up_proj``).
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
    if model.mla is not None:
        return mods | _deepseek_modules(model)
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
        if fam.shared_expert:
            shared = f"{p}.mlp.{SHARED_EXPERT_BLOCK}"
            mods |= {shared, f"{p}.mlp.{SHARED_EXPERT_GATE}"}
            mods |= {f"{shared}.{leaf}" for leaf in SHARED_EXPERT_LEAVES.values()}
    return mods


def _deepseek_modules(model: MoEModelConfig) -> set[str]:
    """Module paths of a DeepSeek-V3 model's decoder layers (MLA, dense MLP or MoE block)."""
    fam = model.family
    att = {leaf for m, leaf in fam.attention_leaves().items() if m in model.dense_shapes}
    mods: set[str] = set()
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}"
        mods |= {p, f"{p}.self_attn", f"{p}.input_layernorm", f"{p}.post_attention_layernorm", f"{p}.mlp",
                 f"{p}.self_attn.kv_a_layernorm"}
        mods |= {f"{p}.self_attn.{leaf}" for leaf in att}
        if model.mla.q_lora_rank is not None:
            mods.add(f"{p}.self_attn.q_a_layernorm")
        if not model.is_moe_layer(layer):
            mods |= {f"{p}.mlp.{leaf}" for leaf in DENSE_MLP_LEAVES.values()}
            continue
        mods |= {f"{p}.mlp.gate", f"{p}.mlp.experts", f"{p}.mlp.{fam.shared_block}"}
        mods |= {f"{p}.mlp.{fam.shared_block}.{leaf}" for leaf in SHARED_EXPERT_LEAVES.values()}
        for e in range(model.num_experts):
            mods |= {f"{p}.mlp.experts.{e}"} | {f"{p}.mlp.experts.{e}.{leaf}" for leaf in fam.expert_leaves}
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
        AdapterFormatError: a non-canonical index, an adapter name inside keys, a LoRA bias
            (``lora_B.bias``).
        DoRAError: ``lora_magnitude_vector`` keys.
        VocabularyTargetError: embedding / LM-head / trainable-token keys.
        UnsupportedTargetError: LoRA on a real module moelora does not serve (router, norms, ...).
        ModelMismatchError: another family's expert names, or a layer / expert index past the
            model's.
        UnmatchedKeysError: keys that name no module of the model.
    """
    fam = model.family
    blocks, leaves = _alt(fam.expert_blocks), _alt(fam.expert_leaves)
    attention = {leaf: m for m, leaf in fam.attention_leaves().items() if m in model.dense_shapes}
    dense_re = re.compile(rf"model\.layers\.{_IDX}\.self_attn\.({_alt(attention)})\.lora_([AB])\.weight")
    dense_mlp = {leaf: m for m, leaf in DENSE_MLP_LEAVES.items()}
    dense_mlp_re = re.compile(rf"model\.layers\.{_IDX}\.mlp\.({_alt(dense_mlp)})\.lora_([AB])\.weight") \
        if fam.dense_layers else None
    fused_re = re.compile(rf"model\.layers\.{_IDX}\.({blocks})\.experts\.(base_layer\.)?lora_([AB])\.weight")
    packed_re = re.compile(rf"model\.layers\.{_IDX}\.({blocks})\.experts\.(gate_up|down)_proj\.lora_([AB])\.weight")
    expert_re = re.compile(
        rf"model\.layers\.{_IDX}\.({blocks})\.experts\.{_IDX}\.({leaves})\.lora_([AB])\.weight")
    shared_module = {leaf: module for module, leaf in SHARED_EXPERT_LEAVES.items()}
    shared_re = re.compile(rf"model\.layers\.{_IDX}\.mlp\.{fam.shared_block}\.({_alt(shared_module)})"
                           rf"\.lora_([AB])\.weight") if fam.shared_expert else None
    foreign_blocks = {b for f in FAMILIES.values() for b in f.expert_blocks} - set(fam.expert_blocks)
    foreign_leaves = ALL_EXPERT_LEAVES - set(fam.expert_leaves)
    foreign_forms = []
    if foreign_blocks:
        foreign_forms.append(rf"(?:{_alt(foreign_blocks)})\.")
    if foreign_leaves:
        foreign_forms.append(rf"[^.]+\.experts\.[0-9]+\.(?:{_alt(foreign_leaves)})\.")
    foreign_re = re.compile(rf"model\.layers\.[0-9]+\.(?:{'|'.join(foreign_forms)})") if foreign_forms else None
    known = _model_modules(model)
    present = set(keys)
    adapter_names: set[str] = set()

    found: list[LoraKey] = []
    # (kind, problem) → keys; the first non-empty entry in ``problems`` order is raised.
    refused: dict[str, list[str]] = {}

    def refuse(kind: str, key: str) -> None:
        refused.setdefault(kind, []).append(key)

    for key in keys:
        if canonical_key(key) != key:
            refuse("index", key)
            continue
        if not key.startswith(PREFIX):
            refuse("unmatched", key)
            continue
        rest = key[len(PREFIX):]
        parts = rest.split(".")
        if "lora_magnitude_vector" in parts:
            refuse("dora", key)
            continue
        if (any(p in VOCABULARY_MODULES for p in parts) or any(p.startswith("lora_embedding_") for p in parts)
                or "trainable_tokens_delta" in parts):
            refuse("vocabulary", key)
            continue
        if named := _NAMED_FACTOR.search(rest):
            adapter_names.add(named[1])
            refuse("adapter_name", key)
            continue
        if m := dense_re.fullmatch(rest):
            layer, leaf, factor = int(m[1]), m[2], m[3]
            path = f"model.layers.{layer}.self_attn.{leaf}"
            rec = LoraKey(key, layer, "dense", attention[leaf], factor, "", None, path)
        elif dense_mlp_re is not None and (m := dense_mlp_re.fullmatch(rest)):
            layer, leaf, factor = int(m[1]), m[2], m[3]
            rec = LoraKey(key, layer, "dense", dense_mlp[leaf], factor, "", None, f"model.layers.{layer}.mlp.{leaf}")
        elif m := fused_re.fullmatch(rest):
            layer, block = int(m[1]), m[2]
            rec = LoraKey(key, layer, "fused", "inner" if m[3] else "outer", m[4], block, None,
                          f"model.layers.{layer}.{block}.experts")
        elif m := packed_re.fullmatch(rest):
            layer, block = int(m[1]), m[2]
            rec = LoraKey(key, layer, "packed", m[3], m[4], block, None,
                          f"model.layers.{layer}.{block}.experts.{m[3]}_proj")
        elif shared_re is not None and (m := shared_re.fullmatch(rest)):
            layer, leaf, factor = int(m[1]), m[2], m[3]
            rec = LoraKey(key, layer, "dense", shared_module[leaf], factor, "", None,
                          f"model.layers.{layer}.mlp.{fam.shared_block}.{leaf}")
        elif m := expert_re.fullmatch(rest):
            layer, block, expert, leaf = int(m[1]), m[2], int(m[3]), m[4]
            rec = LoraKey(key, layer, "expert", fam.expert_module(leaf), m[5], block, expert,
                          f"model.layers.{layer}.{block}.experts.{expert}.{leaf}")
        else:
            if rest.endswith(".lora_B.bias"):
                refuse("bias", key)
            elif foreign_re is not None and foreign_re.match(rest):
                refuse("other_model", key)
            elif _module_path(rest) in known:
                refuse("unsupported", key)
            elif (m := re.match(r"model\.layers\.([0-9]+)\.", rest)) and int(m[1]) >= model.num_layers:
                refuse("other_model", key)
            else:
                refuse("unmatched", key)
            continue
        if rec.layer >= model.num_layers or (rec.expert is not None and rec.expert >= model.num_experts):
            refuse("other_model", key)
            continue
        moe_part = rec.kind != "dense" or rec.target.startswith("shared_")
        if fam.dense_layers and ((moe_part and not model.is_moe_layer(rec.layer))
                                 or (rec.target.startswith("dense_") and model.is_moe_layer(rec.layer))):
            refuse("unmatched", key)  # experts / shared experts on a dense layer, a dense MLP on an MoE layer
            continue
        found.append(rec)

    if "index" in refused:
        shown, problem = describe_non_canonical([(k, canonical_key(k)) for k in refused["index"]], present=present)
        raise AdapterFormatError(adapter, shown, problem)
    names = ", ".join(repr(n) for n in sorted(adapter_names))
    problems: dict[str, tuple[type[AdapterRefusal], str]] = {
        "adapter_name": (AdapterFormatError,
                         f"the keys carry the adapter name {names} after lora_A / lora_B (a model's state_dict(), "
                         "not what save_pretrained writes): peft loads such keys only under that adapter name and "
                         "drops them under any other; save the adapter with peft's save_pretrained"),
        "bias": (AdapterFormatError, "LoRA bias is not supported"),
        "dora": (DoRAError, "DoRA magnitude vectors are not supported"),
        "vocabulary": (VocabularyTargetError, "the adapter changes the embedding / LM head / token vocabulary"),
        "unsupported": (UnsupportedTargetError, "LoRA on modules moelora does not serve (router, norms, "
                                                "the shared expert's sigmoid gate, ...)"),
        "other_model": (ModelMismatchError, f"keys made for another model (this is a {model.num_layers}-layer, "
                                            f"{model.num_experts}-expert {fam.display} model)"),
        "unmatched": (UnmatchedKeysError, "keys that match no module of the model"),
    }
    for kind, (cls, problem) in problems.items():
        if kind in refused:
            bad = refused[kind]
            shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
            raise cls(adapter, shown, f"{len(bad)} key(s): {problem}")
    return found
