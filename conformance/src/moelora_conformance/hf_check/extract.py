"""moelora's tensors taken from the in-memory transformers / peft modules (DESIGN.md §2).

No file is read here: the base weights come from the transformers modules' parameters, the LoRA
factors from peft's layers, reshaped as peft itself does in ``ParamWrapper.get_delta_weight``
(lora_A ``[E·r, in]`` → ``[E, r, in]``; lora_B ``[out, r·E]`` → ``[out, r, E]`` → ``[E, out, r]``),
and every reshaped expert pair is checked against peft's own ``get_delta_weight``.
"""

from __future__ import annotations

import torch

from moelora_conformance.hf_check.hf_model import dense_module
from moelora_core import ModuleLoRA, MoEBaseWeights, SharedExpertWeights
from moelora_core.checkpoint.families import DENSE_MLP_LEAVES, MLA_LEAVES, SHARED_EXPERT_LEAVES
from moelora_core.checkpoint.gpt_oss import gpt_oss_experts, split_gate_up_lora
from moelora_core.moe_activation import SWIGLU_OAI
from moelora_core.shared_expert import dense_mlp

_ADAPTER = "default"


def _unwrap(module):
    """The module under any peft wrappers."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def _deepseek_base(layer, norm_topk_prob: bool, routing) -> tuple:
    """:func:`base_from_hf` of a DeepSeek-V3 layer: MLA projections, and either the dense MLP
    (``moe`` None, the MLP in the shared slot with modules dense_*) or the routed experts with their
    router's correction bias and the ungated shared experts."""
    attn = layer.self_attn
    dense = {m: _unwrap(getattr(attn, leaf)).weight.detach().clone() for m, leaf in MLA_LEAVES.items()
             if getattr(attn, leaf, None) is not None}
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):  # DeepseekV3MLP: a dense first layer
        shared = dense_mlp(*(_unwrap(getattr(mlp, f"{p}_proj")).weight.detach().clone()
                             for p in ("gate", "up", "down")))
        return None, {**dense, **{m: shared.dense(m) for m in shared.modules}}, shared, {}
    experts, router = _unwrap(mlp.experts), _unwrap(mlp.gate)
    moe = MoEBaseWeights(w_gate_up=experts.gate_up_proj.detach().clone(), w_down=experts.down_proj.detach().clone(),
                         router=router.weight.detach().clone(), norm_topk_prob=norm_topk_prob, routing=routing,
                         router_correction_bias=router.e_score_correction_bias.detach().clone())
    se = mlp.shared_experts
    shared = SharedExpertWeights(*(_unwrap(getattr(se, f"{p}_proj")).weight.detach().clone()
                                   for p in ("gate", "up", "down")))
    return moe, {**dense, **{m: shared.dense(m) for m in shared.modules}}, shared, {}


def base_from_hf(layer, *, norm_topk_prob: bool, routing=None) -> tuple[
        MoEBaseWeights | None, dict[str, torch.Tensor], SharedExpertWeights | None, dict[str, torch.Tensor]]:
    """(MoE block weights, dense projection weights [out, in], shared expert or None, dense biases
    [out]) of a decoder layer; the dense weights are "q".."o" and, with a shared expert,
    "shared_gate" / "shared_up" / "shared_down"; the biases those projections have (Qwen2-MoE's q/k/v).
    DeepSeek-V3 (``routing`` its ``GroupLimitedRouting``): the MLA projections; on a dense layer the
    MoE block is None and the shared slot holds the dense MLP."""
    if hasattr(layer.self_attn, "kv_b_proj"):
        return _deepseek_base(layer, norm_topk_prob, routing)
    experts = _unwrap(layer.mlp.experts)
    if hasattr(experts, "gate_up_proj_bias"):  # GPT-OSS: [E, H, 2I] interleaved, biases, router with bias
        w_gu, b_gu, w_d, b_d = gpt_oss_experts(experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach(),
                                               experts.down_proj.detach(), experts.down_proj_bias.detach())
        router = _unwrap(layer.mlp.router)
        moe = MoEBaseWeights(w_gate_up=w_gu, w_down=w_d, router=router.weight.detach().clone(),
                             norm_topk_prob=norm_topk_prob, b_gate_up=b_gu, b_down=b_d,
                             router_bias=router.bias.detach().clone(), activation=SWIGLU_OAI)
    else:
        moe = MoEBaseWeights(
            w_gate_up=experts.gate_up_proj.detach().clone(),  # [E, 2I, H], gate rows first
            w_down=experts.down_proj.detach().clone(),  # [E, H, I]
            router=_unwrap(layer.mlp.gate).weight.detach().clone(),  # [E, H]
            norm_topk_prob=norm_topk_prob,
        )
    dense = {m: _unwrap(getattr(layer.self_attn, f"{m}_proj")).weight.detach().clone() for m in "qkvo"}
    shared = None
    if hasattr(layer.mlp, "shared_expert"):
        se = layer.mlp.shared_expert
        shared = SharedExpertWeights(*(_unwrap(getattr(se, f"{p}_proj")).weight.detach().clone()
                                       for p in ("gate", "up", "down")),
                                     gate=_unwrap(layer.mlp.shared_expert_gate).weight.detach().clone())
        dense.update({m: shared.dense(m) for m in SHARED_EXPERT_LEAVES})
    biases = {m: b.detach().clone() for m in "qkvo"
              if (b := _unwrap(getattr(layer.self_attn, f"{m}_proj")).bias) is not None}
    return moe, dense, shared, biases


def _expert_factors(wrapper) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [E, r, in], B [E, out, r], σ) of one peft ParamWrapper, checked against peft's delta."""
    E = wrapper.num_experts
    r = wrapper.r[_ADAPTER]
    a = wrapper.lora_A[_ADAPTER].weight.detach().float()  # [E·r, in]
    b = wrapper.lora_B[_ADAPTER].weight.detach().float()  # [out, r·E]
    A = a.reshape(E, r, a.shape[1])
    B = b.reshape(b.shape[0], r, E).permute(2, 0, 1)
    sigma = float(wrapper.scaling[_ADAPTER])
    ours = sigma * torch.einsum("eor,eri->eoi", B.double(), A.double())
    theirs = wrapper.get_delta_weight(_ADAPTER).double()  # [E, out, in] for [E, out, in] parameters
    if E == 1 and theirs.dim() == 2:  # peft 0.21.2 returns a one-expert delta without its expert axis
        theirs = theirs[None]
    if getattr(_unwrap(wrapper), "is_transposed", False):  # GPT-OSS's [E, in, out] parameters
        theirs = theirs.transpose(1, 2)
    # peft multiplies in the factors' dtype (fp16 / bf16 when stored so): a wrong reshape is off by O(1)
    rtol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(wrapper.lora_A[_ADAPTER].weight.dtype, 1e-5)
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=rtol, atol=rtol * float(ours.abs().max())):
        raise AssertionError(f"{wrapper.parameter_name}: reshaped factors disagree with peft's get_delta_weight")
    return A.contiguous(), B.contiguous(), sigma


def lora_from_peft(layer, *, intermediate: int) -> dict[str, ModuleLoRA]:
    """moelora module → factors of one decoder layer, from peft's in-memory layers (the shared
    expert's projections, where peft wrapped them, as the dense modules shared_gate / up / down).

    gate and up share the fused A (one ParamWrapper on ``gate_up_proj``): A_gate = A_up = A_e,
    B_gate = B_e[:I], B_up = B_e[I:] (GPT-OSS, interleaved: B_e[0::2], B_e[1::2]).
    """
    out: dict[str, ModuleLoRA] = {}
    wrapper = getattr(layer.mlp, "experts", None)  # None: DeepSeek-V3's dense first layers
    while hasattr(wrapper, "parameter_name"):  # nested peft ParamWrappers, outermost first
        if _ADAPTER in wrapper.lora_A:
            A, B, sigma = _expert_factors(wrapper)
            if wrapper.parameter_name == "gate_up_proj" and getattr(_unwrap(wrapper), "is_transposed", False):
                # GPT-OSS: B's out axis interleaves gate (2i) and up (2i + 1)
                out.update({m: ModuleLoRA(a, b, sigma) for m, (a, b) in split_gate_up_lora(A, B).items()})
            elif wrapper.parameter_name == "gate_up_proj":
                out["gate"] = ModuleLoRA(A, B[:, :intermediate], sigma)
                out["up"] = ModuleLoRA(A.clone(), B[:, intermediate:], sigma)
            elif wrapper.parameter_name == "down_proj":
                out["down"] = ModuleLoRA(A, B, sigma)
            else:
                raise AssertionError(f"unexpected peft target parameter {wrapper.parameter_name!r}")
        wrapper = wrapper.base_layer
    if hasattr(layer.self_attn, "kv_b_proj"):  # DeepSeek-V3: MLA, shared experts or the dense MLP
        modules = [m for m, leaf in MLA_LEAVES.items() if getattr(layer.self_attn, leaf, None) is not None]
        modules += list(SHARED_EXPERT_LEAVES) if hasattr(layer.mlp, "shared_experts") else \
            (list(DENSE_MLP_LEAVES) if not hasattr(layer.mlp, "experts") else [])
    else:
        modules = ["q", "k", "v", "o"] + (list(SHARED_EXPERT_LEAVES) if hasattr(layer.mlp, "shared_expert") else [])
    for m in modules:
        proj = dense_module(layer, m)
        if hasattr(proj, "lora_A") and _ADAPTER in proj.lora_A:
            out[m] = ModuleLoRA(proj.lora_A[_ADAPTER].weight.detach().float(),
                                proj.lora_B[_ADAPTER].weight.detach().float(), float(proj.scaling[_ADAPTER]))
    return out
