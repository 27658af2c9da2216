"""moelora's one layout for a base MoE model's tensors, whatever the checkpoint's format.

Shapes (H hidden, I expert width, E experts, nh/nkv heads, d head_dim, V vocab):

=========================  =====================  ==========================================
field                      shape                  meaning
=========================  =====================  ==========================================
q_proj / k_proj / v_proj   [nh·d, H] / [nkv·d, H] attention projections, ``y = W x``
o_proj                     [H, nh·d]
q_bias / k_bias / v_bias   [nh·d] / [nkv·d]       Qwen2-MoE ``qkv_bias``, GPT-OSS: ``y = W x + b``; else None
o_bias                     [H]                    GPT-OSS ``attention_bias``; else None
sinks                      [nh]                   GPT-OSS per-head sink logits; else None
q_norm / k_norm            [d] or [nh·d]/[nkv·d]  Qwen3-MoE: per head; OLMoE: full width; else None
input_layernorm            [H]                    RMSNorm before attention
post_attention_layernorm   [H]                    RMSNorm before the MoE block
moe                        MoEBaseWeights         w_gate_up [E, 2I, H] (gate rows first),
                                                  w_down [E, H, I], router [E, H], norm_topk_prob;
                                                  GPT-OSS: b_gate_up, b_down, router_bias, swiglu_oai
shared_expert              SharedExpertWeights    Qwen2-MoE: gate_proj / up_proj [Is, H],
                                                  down_proj [H, Is], gate [1, H]; else None
embed_tokens               [V, H]
norm                       [H]                    final RMSNorm
lm_head                    [V, H]                 the embedding itself when tied
=========================  =====================  ==========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.checkpoint.model_config import MoEModelConfig
from moelora_core.errors import InvalidFieldError
from moelora_core.shared_expert import SharedExpertWeights


@dataclass
class DecoderLayerWeights:
    """The base tensors of one decoder layer (see the module table)."""

    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    moe: MoEBaseWeights
    shared_expert: SharedExpertWeights | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    #: (bn, bk) of an fp8 block-scaled checkpoint (DESIGN.md §1), else None.
    weight_block: tuple[int, int] | None = None
    #: dense module → ``weight_scale_inv`` fp32 [⌈out/bn⌉, ⌈in/bk⌉] of each dense weight stored fp8 (that
    #: weight is then float8_e4m3fn, read w8a8); modules absent here are unquantized.
    dense_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def bias(self, module: str) -> torch.Tensor | None:
        """The [out] bias of dense module ``module`` (q, k, v of a model with ``qkv_bias``; o too on
        GPT-OSS), else None."""
        return {"q": self.q_bias, "k": self.k_bias, "v": self.v_bias, "o": self.o_bias}.get(module)

    def dense(self, module: str) -> torch.Tensor:
        """The [out, in] weight of dense module "q", "k", "v", "o", or of a shared-expert module
        ("shared_gate", "shared_up", "shared_down") of a layer that has one.

        Raises:
            InvalidFieldError: a module this layer does not have.
        """
        attention = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.o_proj}
        if module in attention:
            return attention[module]
        if self.shared_expert is None:
            raise InvalidFieldError("module", f"{module!r} is not a dense module of this layer (no shared expert); "
                                              f"expected one of {tuple(attention)}")
        return self.shared_expert.dense(module)


@dataclass
class ModelWeights:
    """A whole base model in moelora's layout."""

    config: MoEModelConfig
    embed_tokens: torch.Tensor
    layers: list[DecoderLayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
