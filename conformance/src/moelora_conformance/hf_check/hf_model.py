"""The side no one here wrote: transformers + peft modules, loaded from the fixtures, run as-is."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from moelora_conformance.fixtures.adapters import PEFT_PATTERN_WARNING


def load_hf(model_dir: Path, adapter_dir: Path | None = None, *, w8a8: bool = False):
    """The transformers model of ``model_dir`` (fp32, eval), wrapped by peft with ``adapter_dir``
    loaded as its only adapter when given. Offline: nothing is downloaded.

    ``w8a8``: ``model_dir`` is an fp8 block-scaled checkpoint and its fp8 modules compute w8a8
    (``hf_w8a8.make_w8a8``, before peft wraps them); without it transformers computes such a
    checkpoint w8a16 on a CPU (it dequantizes the weights at load). An fp8 checkpoint whose block does
    not divide every fp8 weight (partial edge blocks, ``hf_w8a8.partial_block_weights``) is loaded from
    ``hf_w8a8.dequantized_copy``: the same w8a16 weights, dequantized by the oracle instead of by
    transformers, which gets them wrong there."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per tiny model would bury the table

    from moelora_conformance.hf_check.hf_w8a8 import dequantized_copy, make_w8a8, partial_block_weights

    # An fp8 checkpoint with partial edge blocks: transformers takes the block from the scale grid and
    # refuses or mis-dequantizes it, so it loads the oracle's dequantized copy (docs/checkpoints.md).
    source = dequantized_copy(model_dir) if partial_block_weights(Path(model_dir)) else model_dir
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32,
                                                 **_dequantizing(Path(source))).eval()
    if w8a8:
        make_w8a8(model, Path(model_dir))
    if adapter_dir is None:
        return model
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_PATTERN_WARNING, category=RuntimeWarning)
        return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


def _dequantizing(model_dir: Path) -> dict:
    """``from_pretrained`` keyword arguments that make transformers dequantize an fp8 block-scaled
    checkpoint at load on every machine (empty for any other checkpoint).

    transformers 5.17's fine-grained fp8 quantizer dequantizes (Ŵ = W_q · scale_inv) only where no
    fp8-capable GPU is visible (``FineGrainedFP8Quantizer.validate_environment``); on an H100 or H200
    it keeps the fp8 weights for its own kernels, even for a model run on the CPU, and the reference
    would differ by machine (``hf_w8a8.make_w8a8`` refuses such weights by name). Its loading
    attributes (``dequantize``, ``modules_to_not_convert``) replace the stored ones, so the stored
    ``modules_to_not_convert`` is passed back unchanged (``test_fixtures_fp8.py`` pins both)."""
    from transformers import FineGrainedFP8Config

    stored = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    if stored.get("quant_method") != "fp8":
        return {}
    return {"quantization_config": FineGrainedFP8Config(
        dequantize=True, weight_block_size=tuple(stored["weight_block_size"]),
        modules_to_not_convert=stored.get("modules_to_not_convert"))}


def decoder_layers(model) -> list:
    """The decoder layer modules of a transformers or peft-wrapped causal LM."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inner.model.layers)


@torch.no_grad()
def hf_route(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k], topk_ids [T, k]) from the layer's own router module (``mlp.gate``;
    GPT-OSS ``mlp.router``)."""
    router = layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate
    _, weights, ids = router(x)
    return weights, ids


@torch.no_grad()
def hf_moe(layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's sparse MoE block on x [T, H] → [T, H] (with peft's expert LoRA when wrapped; for
    Qwen2-MoE the routed experts plus the gated shared expert, with its LoRA; DeepSeek-V3's dense
    layers: the dense MLP)."""
    out = layer.mlp(x[None])
    if isinstance(out, tuple):  # GptOssMLP returns (hidden_states, router_scores)
        out = out[0]
    return out.reshape(x.shape[0], -1)


def dense_module(layer, module: str):
    """The transformers (or peft-wrapped) module of moelora dense module ``module``: the attention
    projection ``self_attn.<m>_proj`` for "q", "k", "v", "o", the shared expert's
    ``mlp.shared_expert.<leaf>`` for "shared_gate", "shared_up", "shared_down" (Qwen2-MoE;
    DeepSeek-V3 ``mlp.shared_experts``), DeepSeek-V3's MLA projections and dense MLP (``mlp.<leaf>``)."""
    from moelora_core.checkpoint.families import DENSE_MLP_LEAVES, MLA_LEAVES, SHARED_EXPERT_LEAVES

    if module in SHARED_EXPERT_LEAVES:
        block = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp.shared_expert
        return getattr(block, SHARED_EXPERT_LEAVES[module])
    if module in DENSE_MLP_LEAVES:  # DeepSeek-V3's dense first-layer MLP
        return getattr(layer.mlp, DENSE_MLP_LEAVES[module])
    if hasattr(layer.self_attn, "kv_b_proj"):  # DeepSeek-V3's MLA
        return getattr(layer.self_attn, MLA_LEAVES[module])
    return getattr(layer.self_attn, f"{module}_proj")


@torch.no_grad()
def hf_dense(layer, module: str, x: torch.Tensor) -> torch.Tensor:
    """The layer's dense projection ``module`` (:func:`dense_module`) on x [T, in] → [T, out]."""
    return dense_module(layer, module)(x)
