"""Synthetic checkpoints and PEFT-format adapters, written with safetensors + JSON only.

For tests that must not depend on transformers or peft (core's own tests, an engine's loader
tests): tiny random models in every base format the readers accept (per-expert keys of each
family, the fused 3-D form, sharded with or without an index), and adapters in the PEFT key
layouts (fused ``target_parameters``, legacy per-expert, dense). The real-format ground truth is
the conformance fixtures built by transformers and peft themselves; these files follow the same
layouts, written out element by element (not by the readers' reshapes) so a reader bug does not
cancel against a writer bug.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.checkpoint.families import DENSE_LEAVES, DENSE_MLP_LEAVES, FAMILIES, SHARED_EXPERT_LEAVES
from moelora_core.checkpoint.layout import DecoderLayerWeights, ModelWeights
from moelora_core.checkpoint.model_config import MoEModelConfig
from moelora_core.shared_expert import SharedExpertWeights

_META = {"format": "pt"}


def model_config_dict(
    family: str,
    *,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    vocab: int = 32,
    norm_topk_prob: bool = True,
    tie_word_embeddings: bool = False,
    **extra: object,
) -> dict:
    """A ``config.json`` object as transformers writes it for ``family`` (field names per family).
    A Qwen2-MoE gets ``shared_expert_intermediate_size`` 2·inter and ``qkv_bias`` false unless
    ``extra`` says otherwise."""
    fam = FAMILIES[family]
    arch = fam.architecture
    raw = {
        "architectures": [arch], "model_type": family, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_experts_per_tok": top_k,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "dtype": "float32",
        fam.intermediate_key: inter, fam.experts_keys[0]: experts,
    }
    if head_dim is not None:
        raw["head_dim"] = head_dim
    if family != "mixtral":
        raw["norm_topk_prob"] = norm_topk_prob
    if fam.shared_expert:
        raw.update(shared_expert_intermediate_size=2 * inter, qkv_bias=False)
    raw.update(extra)
    return raw


def random_model(config: MoEModelConfig, seed: int = 0) -> ModelWeights:
    """Random weights in moelora's layout for ``config`` (N(0, 1/in) linears, 1 + N(0, 0.01) norms)."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts  # noqa: E741

    def lin(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    dense = c.dense_shapes
    si = c.shared_expert_intermediate_size
    qk = {"per_head": (c.head_dim, c.head_dim), "full": (dense["q"][1], dense["k"][1])}.get(c.family.qk_norm)
    layers = []
    for _ in range(c.num_layers):
        layers.append(DecoderLayerWeights(
            q_proj=lin(dense["q"][1], H), k_proj=lin(dense["k"][1], H), v_proj=lin(dense["v"][1], H),
            o_proj=lin(H, dense["o"][0]),
            q_norm=norm(qk[0]) if qk else None, k_norm=norm(qk[1]) if qk else None,
            input_layernorm=norm(H), post_attention_layernorm=norm(H),
            moe=MoEBaseWeights(w_gate_up=lin(E, 2 * I, H), w_down=lin(E, H, I), router=lin(E, H),
                               norm_topk_prob=c.norm_topk_prob),
            shared_expert=None if si is None else SharedExpertWeights(lin(si, H), lin(si, H), lin(H, si), lin(1, H)),
            **({f"{m}_bias": 0.5 * torch.randn(dense[m][1], generator=gen) for m in "qkv"} if c.qkv_bias else {}),
        ))
    embed = torch.randn(c.vocab_size, H, generator=gen)
    return ModelWeights(config=c, embed_tokens=embed, layers=layers, norm=norm(H),
                        lm_head=embed if c.tie_word_embeddings else lin(c.vocab_size, H))


def checkpoint_tensors(weights: ModelWeights, *, fused: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's key → tensor map: per-expert family names, or the fused 3-D form."""
    c = weights.config
    fam = c.family
    I = c.moe_intermediate_size  # noqa: E741
    out = {"model.embed_tokens.weight": weights.embed_tokens, "model.norm.weight": weights.norm}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = weights.lm_head
    for li, layer in enumerate(weights.layers):
        p = f"model.layers.{li}"
        for m in "qkvo":
            out[f"{p}.self_attn.{DENSE_LEAVES[m]}.weight"] = layer.dense(m)
            if layer.bias(m) is not None:
                out[f"{p}.self_attn.{DENSE_LEAVES[m]}.bias"] = layer.bias(m)
        if layer.q_norm is not None:
            out[f"{p}.self_attn.q_norm.weight"] = layer.q_norm
            out[f"{p}.self_attn.k_norm.weight"] = layer.k_norm
        out[f"{p}.input_layernorm.weight"] = layer.input_layernorm
        out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm
        if layer.shared_expert is not None:
            se = layer.shared_expert
            out[f"{p}.mlp.shared_expert.gate_proj.weight"] = se.gate_proj
            out[f"{p}.mlp.shared_expert.up_proj.weight"] = se.up_proj
            out[f"{p}.mlp.shared_expert.down_proj.weight"] = se.down_proj
            out[f"{p}.mlp.shared_expert_gate.weight"] = se.gate
        moe = layer.moe
        if fused:
            out[f"{p}.mlp.gate.weight"] = moe.router
            out[f"{p}.mlp.experts.gate_up_proj"] = moe.w_gate_up
            out[f"{p}.mlp.experts.down_proj"] = moe.w_down
            continue
        block = fam.expert_block
        g, u, d = fam.expert_leaves
        out[f"{p}.{block}.gate.weight"] = moe.router
        for e in range(c.num_experts):
            out[f"{p}.{block}.experts.{e}.{g}.weight"] = moe.w_gate_up[e, :I]
            out[f"{p}.{block}.experts.{e}.{u}.weight"] = moe.w_gate_up[e, I:]
            out[f"{p}.{block}.experts.{e}.{d}.weight"] = moe.w_down[e]
    return out


def write_checkpoint(
    directory: str | Path,
    config_dict: Mapping[str, object],
    tensors: Mapping[str, torch.Tensor],
    *,
    shards: int = 1,
    index: bool = True,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``config.json`` and the tensors (``model.safetensors``, or ``shards`` files
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` when ``index``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config_dict), indent=2, sort_keys=True))
    cast = {k: (v if dtype is None else v.to(dtype)).contiguous().clone() for k, v in tensors.items()}
    if shards == 1:
        save_file(cast, str(directory / "model.safetensors"), metadata=_META)
        return directory
    keys = sorted(cast)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: cast[k] for k in keys[i::shards]}
        save_file(part, str(directory / name), metadata=_META)
        weight_map.update(dict.fromkeys(part, name))
    if index:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2, sort_keys=True))
    return directory


def fused_lora_A(A: torch.Tensor) -> torch.Tensor:
    """[E, r, in] → PEFT's fused ``[E·r, in]``: row ``e·r + j`` is expert e's rank-j row."""
    E, r, fin = A.shape
    out = torch.empty(E * r, fin, dtype=A.dtype)
    for e in range(E):
        for j in range(r):
            out[e * r + j] = A[e, j]
    return out


def fused_lora_B(B: torch.Tensor) -> torch.Tensor:
    """[E, out, r] → PEFT's fused ``[out, r·E]``: column ``j·E + e`` is expert e's rank-j column."""
    E, fout, r = B.shape
    out = torch.empty(fout, r * E, dtype=B.dtype)
    for e in range(E):
        for j in range(r):
            out[:, j * E + e] = B[e, :, j]
    return out


def adapter_tensors(
    model: MoEModelConfig,
    layers: Mapping[int, Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    *,
    expert_format: str = "fused",
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """PEFT keys for moelora-layout factors.

    Args:
        model: the model.
        layers: layer → module → (A, B); MoE modules A [E, r, in], B [E, out, r] (expert dim 1 for a
            factor shared by every expert: shared-outer, fully shared); dense (q/k/v/o or MLA's,
            shared_gate / shared_up / shared_down, DeepSeek-V3's dense_*) [r, in] / [out, r]. For "fused" and "packed",
            gate and up must be given together with the same A.
        expert_format: "fused" (``target_parameters``, PEFT 2-D: A [E_A·r, in], B [out, r·E_B]),
            "packed" (3-D ``experts.gate_up_proj.lora_A.weight`` [E_A, r, H] etc., the SGLang /
            Megatron-Bridge export) or "per_expert" (legacy module names).

    Returns:
        (key → tensor, {"target_modules": [...], "target_parameters": [...]}) for the config.

    Raises:
        ValueError: fused gate/up with different A, or only one of them.
    """
    fam = model.family
    out: dict[str, torch.Tensor] = {}
    target_modules: set[str] = set()
    target_parameters: set[str] = set()
    pre = "base_model.model.model.layers"
    # peft targets parameters model-wide: with gate_up and down both targeted, gate_up is the inner
    # wrapper (experts.base_layer) on every layer.
    fused_both = expert_format == "fused" and all(
        any(m in modules for modules in layers.values() for m in group) for group in (("gate", "up"), ("down",)))
    for li, modules in layers.items():
        attention = fam.attention_leaves()
        for m, (A, B) in modules.items():
            if m in attention:
                key = f"{pre}.{li}.self_attn.{attention[m]}"
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A, B
                target_modules.add(attention[m])
            elif m in SHARED_EXPERT_LEAVES:  # Qwen2-MoE's / DeepSeek-V3's shared expert: plain nn.Linear modules
                key = f"{pre}.{li}.mlp.{fam.shared_block}.{SHARED_EXPERT_LEAVES[m]}"
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A, B
                target_modules.add(f"{fam.shared_block}.{SHARED_EXPERT_LEAVES[m]}")
            elif m in DENSE_MLP_LEAVES:  # DeepSeek-V3's dense first-layer MLP (peft refuses to wrap it)
                key = f"{pre}.{li}.mlp.{DENSE_MLP_LEAVES[m]}"
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A, B
                target_modules.add(f"mlp.{DENSE_MLP_LEAVES[m]}")
            elif expert_format == "per_expert":
                leaf = fam.expert_leaf(m)
                for e in range(A.shape[0]):
                    key = f"{pre}.{li}.{fam.expert_block}.experts.{e}.{leaf}"
                    out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A[e], B[e]
                target_modules.add(leaf)
        if expert_format not in ("fused", "packed"):
            continue
        has_gu = "gate" in modules or "up" in modules
        if has_gu and ("gate" not in modules or "up" not in modules
                       or not torch.equal(modules["gate"][0], modules["up"][0])):
            raise ValueError("fused gate_up needs gate and up with one shared A")
        if expert_format == "packed":
            for stage, pair in (("gate_up", ("gate", "up")), ("down", ("down",))):
                if pair[0] in modules:
                    key = f"{pre}.{li}.mlp.experts.{stage}_proj"
                    out[f"{key}.lora_A.weight"] = modules[pair[0]][0].clone()  # [E_A, r, in]
                    out[f"{key}.lora_B.weight"] = torch.cat([modules[m][1] for m in pair], dim=1)  # [E_B, out, r]
                    target_parameters.add(f"mlp.experts.{stage}_proj")
            continue
        if has_gu:
            key = f"{pre}.{li}.mlp.experts" + (".base_layer" if fused_both else "")
            out[f"{key}.lora_A.weight"] = fused_lora_A(modules["gate"][0])
            out[f"{key}.lora_B.weight"] = fused_lora_B(torch.cat([modules["gate"][1], modules["up"][1]], dim=1))
            target_parameters.add("mlp.experts.gate_up_proj")
        if "down" in modules:
            key = f"{pre}.{li}.mlp.experts"
            out[f"{key}.lora_A.weight"] = fused_lora_A(modules["down"][0])
            out[f"{key}.lora_B.weight"] = fused_lora_B(modules["down"][1])
            target_parameters.add("mlp.experts.down_proj")
    return out, {"target_modules": sorted(target_modules), "target_parameters": sorted(target_parameters)}


def write_adapter(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, object],
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``adapter_config.json`` (PEFT LoRA defaults overridden by ``config``) and
    ``adapter_model.safetensors``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    full = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_rslora": False, "use_dora": False,
            "rank_pattern": {}, "alpha_pattern": {}, "target_modules": [], "target_parameters": None,
            "lora_dropout": 0.0, "bias": "none", "modules_to_save": None}
    full.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(full, indent=2, sort_keys=True))
    cast = {k: (v if dtype is None else v.to(dtype)).contiguous().clone() for k, v in tensors.items()}
    save_file(cast, str(directory / "adapter_model.safetensors"), metadata=_META)
    return directory
