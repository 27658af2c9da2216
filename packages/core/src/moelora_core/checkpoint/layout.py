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
                                                  down_proj [H, Is], gate [1, H]; DeepSeek-V3: no
                                                  gate; else None
mla                        MLAWeights             DeepSeek-V3: the MLA projections and norms (q_proj,
                                                  k_proj, v_proj None; o_proj [H, nh·v_head_dim])
dense_mlp                  SharedExpertWeights    DeepSeek-V3's layers < first_k_dense_replace: the
                                                  ungated dense MLP (modules dense_*), ``moe`` None
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
class MLAWeights:
    """DeepSeek-V3's MLA projections of one layer (DESIGN.md §1), [out, in] each.

    Attributes:
        q_proj: [nh·qk_head_dim, H] when the config has no ``q_lora_rank``, else None.
        q_a_proj: [q_lora_rank, H]; q_a_layernorm: [q_lora_rank]; q_b_proj: [nh·qk_head_dim,
            q_lora_rank] (None without ``q_lora_rank``).
        kv_a_proj: [kv_lora_rank + rope_dim, H] (``kv_a_proj_with_mqa``); kv_a_layernorm:
            [kv_lora_rank]; kv_b_proj: [nh·(nope_dim + v_head_dim), kv_lora_rank].
    """

    q_proj: torch.Tensor | None
    q_a_proj: torch.Tensor | None
    q_a_layernorm: torch.Tensor | None
    q_b_proj: torch.Tensor | None
    kv_a_proj: torch.Tensor
    kv_a_layernorm: torch.Tensor
    kv_b_proj: torch.Tensor

    def dense(self, module: str) -> torch.Tensor | None:
        """The [out, in] weight of MLA module "q", "q_a", "q_b", "kv_a" or "kv_b" (None where absent)."""
        return {"q": self.q_proj, "q_a": self.q_a_proj, "q_b": self.q_b_proj, "kv_a": self.kv_a_proj,
                "kv_b": self.kv_b_proj}.get(module)

    def map(self, fn) -> MLAWeights:
        """The same weights with ``fn`` applied to each tensor (None stays None)."""
        def f(t):
            return None if t is None else fn(t)
        return MLAWeights(f(self.q_proj), f(self.q_a_proj), f(self.q_a_layernorm), f(self.q_b_proj),
                          f(self.kv_a_proj), f(self.kv_a_layernorm), f(self.kv_b_proj))


@dataclass
class DecoderLayerWeights:
    """The base tensors of one decoder layer (see the module table)."""

    q_proj: torch.Tensor | None
    k_proj: torch.Tensor | None
    v_proj: torch.Tensor | None
    o_proj: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    moe: MoEBaseWeights | None
    shared_expert: SharedExpertWeights | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    mla: MLAWeights | None = None
    dense_mlp: SharedExpertWeights | None = None
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
        ("shared_gate", "shared_up", "shared_down") of a layer that has one; DeepSeek-V3: "q" or
        "q_a"/"q_b", "kv_a", "kv_b", "o", and the shared expert's or the dense MLP's ("dense_*").

        Raises:
            InvalidFieldError: a module this layer does not have.
        """
        attention = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.o_proj}
        if self.mla is not None:  # DeepSeek-V3: MLA projections, o, the shared expert or the dense MLP
            weight = self.o_proj if module == "o" else self.mla.dense(module)
            for mlp in (self.shared_expert, self.dense_mlp):
                if weight is None and mlp is not None and module in mlp.modules:
                    weight = mlp.dense(module)
            if weight is None:
                raise InvalidFieldError("module", f"{module!r} is not a dense module of this layer")
            return weight
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
