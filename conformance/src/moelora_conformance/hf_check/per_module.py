"""A per-module reference for legacy per-expert adapters, built without moelora's readers.

DESIGN.md §1: moelora follows the adapter file's own modules. For a legacy per-expert adapter
(``mlp.experts.{e}.gate_proj`` etc., Mixtral ``w1/w3/w2``) each module has its own A, B, r and α, so
the reference is the transformers layer with every delta merged into its weights,
``W'[e] = W[e] + σ·B_e·A_e`` (σ = α/r, or α/√r with rsLoRA, from adapter_config.json), computed in
fp64 and run by transformers' own forward. peft 0.21.2 instead fuses gate and up into one module of
rank 2r and α 2α, which under rsLoRA scales gate and up by √2·α/√r: that is the documented
divergence, which this reference does not share.
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
    """Decoder layers of a deep copy of ``base_model`` (a plain transformers model) with the
    adapter's per-module deltas merged into the expert stacks and attention projections.

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
    inter = _unwrap(layers[0].mlp.experts).down_proj.shape[-1]
    expert_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.lora_A\.weight")
    dense_re = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.self_attn\.(\w+)\.lora_A\.weight")
    with torch.no_grad():
        for key in sorted(state):
            if not key.endswith("lora_A.weight"):
                continue
            a = state[key].double()
            b = state[key.replace("lora_A", "lora_B")].double()
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
            else:
                raise AssertionError(f"the per-module reference does not understand {key}")
            target.copy_((target.double() + delta).to(target.dtype))
    return layers
