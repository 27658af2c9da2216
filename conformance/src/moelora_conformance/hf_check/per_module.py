"""A per-module reference for legacy per-expert adapters, built without moelora's readers.

DESIGN.md §1: moelora follows the adapter file's own modules. For a legacy per-expert adapter
(``mlp.experts.{e}.gate_proj`` etc., Mixtral ``w1/w3/w2``) each module has its own A, B, r and α, so
the reference is the transformers layer with every delta merged into its weights,
``W'[e] = W[e] + σ·B_e·A_e`` (σ = α/r, or α/√r with rsLoRA, from adapter_config.json), computed in
fp64 and run by transformers' own forward. peft 0.21.2 instead fuses gate and up into one module of
rank 2r and α 2α, which under rsLoRA scales gate and up by √2·α/√r: that is the documented
divergence, which this reference does not share.

It also serves the shared-outer and fully shared expert adapters peft cannot load
(conformance/docs/checkpoints.md), from the file's own tensors: 3-D ``experts.gate_up_proj.lora_A``
``[E_A, r, H]`` / ``lora_B`` ``[E_B, 2I, r]`` (and ``down_proj``), and PEFT's 2-D fused keys with
expert count 1 on the shared side (row ``e·r + j`` of A is expert e's rank-j row, column
``j·E_B + e`` of B its rank-j column; E_A = rows / r, E_B = columns / r), each expert e getting
``σ·B_{e_B}·A_{e_A}`` with ``e_X = 0`` where the count is 1.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from moelora_conformance.hf_check.extract import _unwrap


def merged_reference_layers(base_model, adapter_dir: Path) -> list:
    """Decoder layers of :func:`merged_reference_model`."""
    return list(merged_reference_model(base_model, adapter_dir).model.layers)


def _expert_delta(a: torch.Tensor, b: torch.Tensor, r: int, e: int, packed: bool) -> torch.Tensor:
    """Expert e's B_e @ A_e [out, in] from a 3-D (``packed``) or 2-D fused factor pair, read element
    by element; a factor with expert count 1 serves every expert."""
    if packed:
        ea, eb = a.shape[0], b.shape[0]
        return b[0 if eb == 1 else e] @ a[0 if ea == 1 else e]
    ea, eb = a.shape[0] // r, b.shape[1] // r
    rows = [(0 if ea == 1 else e) * r + j for j in range(r)]
    cols = [j * eb + (0 if eb == 1 else e) for j in range(r)]
    return b[:, cols] @ a[rows]


def merged_reference_model(base_model, adapter_dir: Path):
    """A deep copy of ``base_model`` (a plain transformers model) with the adapter's per-module
    deltas merged into the expert stacks and attention projections (DeepSeek-V3: MLA projections,
    shared experts and the dense MLP too).

    Raises:
        AssertionError: a key this reference does not understand (it only serves the legacy
            fixtures: per-expert experts and dense q/k/v/o, no patterns).
    """
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AssertionError("the per-module reference does not implement rank/alpha patterns")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    sigma = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    model = copy.deepcopy(base_model)
    layers = list(model.model.layers)
    inter = next(_unwrap(la.mlp.experts).down_proj.shape[-1] for la in layers if hasattr(la.mlp, "experts"))
    expert_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.lora_A\.weight")
    packed_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj"
                           r"\.lora_A\.weight")
    fused_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.(base_layer\.)?lora_A\.weight")
    params = [p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or []]
    both = {"gate_up_proj", "down_proj"} <= set(params)
    dense_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.self_attn\.(\w+)\.lora_A\.weight")
    # DeepSeek-V3: the shared experts and the dense first-layer MLP (plain nn.Linear modules)
    mlp_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.mlp\.(shared_experts\.)?(gate|up|down)_proj"
                        r"\.lora_A\.weight")
    with torch.no_grad():
        for key in sorted(state):
            if not key.endswith("lora_A.weight"):
                continue
            a = state[key].double()
            b = state[key.replace("lora_A", "lora_B")].double()
            if (m := packed_re.fullmatch(key)) or (m := fused_re.fullmatch(key)):
                packed = m.re is packed_re
                stage = m[2] if packed else ("gate_up" if m[2] or (not both and params == ["gate_up_proj"])
                                             else "down")
                experts = _unwrap(layers[int(m[1])].mlp.experts)
                stack = experts.gate_up_proj if stage == "gate_up" else experts.down_proj
                for e in range(stack.shape[0]):
                    delta = sigma * _expert_delta(a, b, r, e, packed)
                    stack[e].copy_((stack[e].double() + delta).to(stack.dtype))
                continue
            delta = sigma * (b @ a)  # [out, in]
            if m := expert_re.fullmatch(key):
                layer, e, leaf = int(m[1]), int(m[2]), m[3]
                experts = _unwrap(layers[layer].mlp.experts)
                if leaf in ("gate_proj", "w1"):
                    target = experts.gate_up_proj[e, :inter]
                elif leaf in ("up_proj", "w3"):
                    target = experts.gate_up_proj[e, inter:]
                elif leaf in ("down_proj", "w2"):
                    target = experts.down_proj[e]
                else:
                    raise AssertionError(f"unknown expert leaf in {key}")
            elif m := dense_re.fullmatch(key):
                target = _unwrap(getattr(layers[int(m[1])].self_attn, m[2])).weight
            elif m := mlp_re.fullmatch(key):
                mlp = layers[int(m[1])].mlp
                target = _unwrap(getattr(mlp.shared_experts if m[2] else mlp, f"{m[3]}_proj")).weight
            else:
                raise AssertionError(f"the per-module reference does not understand {key}")
            target.copy_((target.double() + delta).to(target.dtype))
    return model
