"""The supported MoE model families and how each names its tensors and config fields.

Facts from transformers 5.17 (``save_pretrained`` output and the modeling code):

=============  ===========================================  ====================================
family         per-expert keys on disk (layer l, expert e)   config fields
=============  ===========================================  ====================================
qwen3_moe      model.layers.l.mlp.experts.e.gate_proj /       moe_intermediate_size,
               up_proj / down_proj .weight;                   num_experts | num_local_experts,
               router model.layers.l.mlp.gate.weight          norm_topk_prob (default False),
                                                              q_norm/k_norm per head [head_dim]
mixtral        model.layers.l.block_sparse_moe.experts.e.     intermediate_size, num_local_experts;
               w1 (gate) / w3 (up) / w2 (down) .weight;       top-k weights always renormalised
               router model.layers.l.block_sparse_moe.gate
olmoe          as qwen3_moe                                   intermediate_size, num_experts,
                                                              norm_topk_prob (default False),
                                                              q_norm [H], k_norm [kv_heads·head_dim]
gpt_oss        fused only (no per-expert form):                intermediate_size, num_local_experts;
               model.layers.l.mlp.experts.gate_up_proj        top-k softmax (= renormalised);
               [E, H, 2I] gate/up interleaved, _bias [E, 2I], layer_types + sliding_window;
               down_proj [E, I, H], _bias [E, H]; router      attention_bias (q/k/v/o);
               mlp.router.weight [E, H], .bias [E];           self_attn.sinks [heads]
               (:mod:`.gpt_oss`)
qwen2_moe      as qwen3_moe, plus the shared expert           moe_intermediate_size, num_experts,
               model.layers.l.mlp.shared_expert.gate_proj /   shared_expert_intermediate_size,
               up_proj / down_proj .weight and its sigmoid    norm_topk_prob (default False),
               gate model.layers.l.mlp.shared_expert_gate.    qkv_bias (q/k/v biases, default
               weight [1, H]; self_attn.{q,k,v}_proj.bias     true); no q/k norm
deepseek_v3    as qwen3_moe on layers l >= first_k_dense_replace  moe_intermediate_size, n_routed_experts,
               (router mlp.gate.weight [E, H] and its buffer   n_group, topk_group, routed_scaling_factor,
               mlp.gate.e_score_correction_bias [E]), the      norm_topk_prob, n_shared_experts,
               ungated mlp.shared_experts.{gate,up,down}_proj; first_k_dense_replace, intermediate_size
               layers l < first_k_dense_replace: a dense MLP    (dense MLP), MLA: q_lora_rank (null =
               mlp.{gate,up,down}_proj; MLA self_attn.         q_proj), kv_lora_rank, qk_nope_head_dim,
               q_a_proj, q_a_layernorm, q_b_proj (or q_proj),  qk_rope_head_dim, v_head_dim,
               kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,  rope_interleave, rope_parameters
               o_proj                                          (default or yarn)
=============  ===========================================  ====================================

Qwen2-MoE's MoE block (transformers ``Qwen2MoeSparseMoeBlock``) adds a dense shared expert to the
routed experts: ``y = routed(x) + sigmoid(w_sg · x) · W_down (silu(W_gate x) ⊙ W_up x)``, where
``w_sg`` [1, H] is ``shared_expert_gate`` and W_gate / W_up / W_down the shared expert's (DESIGN.md §1).

The fused 3-D form, as the in-memory modules hold it (and as transformers also loads it), is
``model.layers.l.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
``model.layers.l.mlp.experts.down_proj`` [E, H, I], router ``model.layers.l.mlp.gate.weight`` — for
every family, Mixtral included (transformers renames ``block_sparse_moe`` to ``mlp`` on load).
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora_core.moe_activation import SILU, SWIGLU_OAI, MoEActivation


@dataclass(frozen=True)
class Family:
    """How one model family names things.

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        display: a human name.
        architecture: the ``*ForCausalLM`` class name transformers writes in ``architectures``.
        expert_block: the MoE block's name in per-expert checkpoints ("mlp", "block_sparse_moe").
        expert_blocks: every name the MoE block may carry in a checkpoint or adapter (per-expert
            name first, then "mlp" for the fused form).
        expert_leaves: per-expert projection names (gate, up, down) (``gate_proj, up_proj,
            down_proj`` or Mixtral's ``w1, w3, w2``).
        intermediate_key: config field holding the expert width I.
        experts_keys: config fields that may hold E, first found wins.
        always_renormalize: the top-k router weights are renormalised whatever the config says.
        qk_norm: "per_head" (RMSNorm over head_dim), "full" (over heads·head_dim) or None.
        shared_expert: the MoE block has a dense shared expert (``mlp.shared_expert`` and its
            sigmoid gate ``mlp.shared_expert_gate``), with width ``shared_expert_intermediate_size``.
        router_leaf: the router's module under the MoE block ("gate"; GPT-OSS "router").
        gate_up_layout: the checkpoint's (and PEFT's) gate/up columns: "halves" or GPT-OSS's
            "interleaved" (the readers convert to halves; DESIGN.md §1).
        expert_biases: the experts and the router have biases (GPT-OSS).
        activation: the experts' activation (SiLU; GPT-OSS's clamped ``swiglu_oai``).
        attention_sinks: per-head learned sink logits ``self_attn.sinks`` (GPT-OSS).
        shared_block: the shared expert's module under ``mlp`` ("shared_expert"; DeepSeek-V3
            "shared_experts").
        shared_gate: the shared expert has a sigmoid gate ``mlp.shared_expert_gate`` (Qwen2-MoE).
        attention: "mha" (q/k/v/o) or "mla" (DeepSeek-V3's multi-head latent attention).
        routing: "softmax" or "grouped_sigmoid" (DeepSeek-V3; ``moelora_core.routing``).
        dense_layers: the first ``first_k_dense_replace`` layers are dense MLPs (DeepSeek-V3).
    """

    model_type: str
    display: str
    architecture: str
    expert_block: str
    expert_blocks: tuple[str, ...]
    expert_leaves: tuple[str, str, str]
    intermediate_key: str
    experts_keys: tuple[str, ...]
    always_renormalize: bool
    qk_norm: str | None
    shared_expert: bool = False
    router_leaf: str = "gate"
    gate_up_layout: str = "halves"
    expert_biases: bool = False
    activation: MoEActivation = SILU
    attention_sinks: bool = False
    shared_block: str = "shared_expert"
    shared_gate: bool = True
    attention: str = "mha"
    routing: str = "softmax"
    dense_layers: bool = False

    def attention_leaves(self) -> dict[str, str]:
        """moelora dense module → leaf under ``self_attn`` of every projection this family may have
        (MLA: q or q_a/q_b, kv_a, kv_b, o; the config says which of q / q_a+q_b exists)."""
        return dict(MLA_LEAVES) if self.attention == "mla" else dict(DENSE_LEAVES)

    def expert_leaf(self, module: str) -> str:
        """The per-expert leaf name of moelora module ``module`` ("gate", "up", "down")."""
        return self.expert_leaves[("gate", "up", "down").index(module)]

    def expert_module(self, leaf: str) -> str | None:
        """moelora's module name ("gate", "up", "down") of per-expert leaf ``leaf``, or None."""
        return ("gate", "up", "down")[self.expert_leaves.index(leaf)] if leaf in self.expert_leaves else None


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    display="Qwen3-MoE",
    architecture="Qwen3MoeForCausalLM",
    expert_block="mlp",
    expert_blocks=("mlp",),
    expert_leaves=("gate_proj", "up_proj", "down_proj"),
    intermediate_key="moe_intermediate_size",
    experts_keys=("num_experts", "num_local_experts"),
    always_renormalize=False,
    qk_norm="per_head",
)
MIXTRAL = Family(
    model_type="mixtral",
    display="Mixtral",
    architecture="MixtralForCausalLM",
    expert_block="block_sparse_moe",
    expert_blocks=("block_sparse_moe", "mlp"),
    expert_leaves=("w1", "w3", "w2"),
    intermediate_key="intermediate_size",
    experts_keys=("num_local_experts", "num_experts"),
    always_renormalize=True,
    qk_norm=None,
)
OLMOE = Family(
    model_type="olmoe",
    display="OLMoE",
    architecture="OlmoeForCausalLM",
    expert_block="mlp",
    expert_blocks=("mlp",),
    expert_leaves=("gate_proj", "up_proj", "down_proj"),
    intermediate_key="intermediate_size",
    experts_keys=("num_experts", "num_local_experts"),
    always_renormalize=False,
    qk_norm="full",
)

QWEN2_MOE = Family(
    model_type="qwen2_moe",
    display="Qwen2-MoE",
    architecture="Qwen2MoeForCausalLM",
    expert_block="mlp",
    expert_blocks=("mlp",),
    expert_leaves=("gate_proj", "up_proj", "down_proj"),
    intermediate_key="moe_intermediate_size",
    experts_keys=("num_experts",),
    always_renormalize=False,
    qk_norm=None,
    shared_expert=True,
)

GPT_OSS = Family(
    model_type="gpt_oss",
    display="GPT-OSS",
    architecture="GptOssForCausalLM",
    expert_block="mlp",
    expert_blocks=("mlp",),
    expert_leaves=("gate_proj", "up_proj", "down_proj"),  # never on disk: GPT-OSS stores the fused form only
    intermediate_key="intermediate_size",
    experts_keys=("num_local_experts",),
    always_renormalize=True,  # softmax over the top-k logits == softmax, top-k, renormalise
    qk_norm=None,
    router_leaf="router",
    gate_up_layout="interleaved",
    expert_biases=True,
    activation=SWIGLU_OAI,
    attention_sinks=True,
)

DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    display="DeepSeek-V3",
    architecture="DeepseekV3ForCausalLM",
    expert_block="mlp",
    expert_blocks=("mlp",),
    expert_leaves=("gate_proj", "up_proj", "down_proj"),
    intermediate_key="moe_intermediate_size",
    experts_keys=("n_routed_experts", "num_local_experts"),
    always_renormalize=False,
    qk_norm=None,
    shared_expert=True,
    shared_block="shared_experts",
    shared_gate=False,
    attention="mla",
    routing="grouped_sigmoid",
    dense_layers=True,
)

#: model_type → family.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN3_MOE, MIXTRAL, OLMOE, QWEN2_MOE, GPT_OSS,
                                                         DEEPSEEK_V3)}

#: Leaf names of every family's per-expert projections (to recognise another family's adapter).
ALL_EXPERT_LEAVES: frozenset[str] = frozenset(leaf for f in FAMILIES.values() for leaf in f.expert_leaves)

#: moelora dense module → the attention projection's leaf name.
DENSE_LEAVES: dict[str, str] = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
#: DeepSeek-V3's MLA: moelora dense module → leaf under ``self_attn`` (DESIGN.md §1).
MLA_LEAVES: dict[str, str] = {"q": "q_proj", "q_a": "q_a_proj", "q_b": "q_b_proj", "kv_a": "kv_a_proj_with_mqa",
                              "kv_b": "kv_b_proj", "o": "o_proj"}
#: DeepSeek-V3's dense first-layer MLP: moelora module → leaf under ``model.layers.l.mlp``.
DENSE_MLP_LEAVES: dict[str, str] = {"dense_gate": "gate_proj", "dense_up": "up_proj", "dense_down": "down_proj"}

#: moelora shared-expert module → its leaf under ``model.layers.l.mlp.shared_expert`` (Qwen2-MoE).
SHARED_EXPERT_LEAVES: dict[str, str] = {"shared_gate": "gate_proj", "shared_up": "up_proj",
                                        "shared_down": "down_proj"}
#: The shared expert's module (Qwen2-MoE; DeepSeek-V3's is ``Family.shared_block``) and its sigmoid
#: gate's, under ``model.layers.l.mlp``.
SHARED_EXPERT_BLOCK = "shared_expert"
SHARED_EXPERT_GATE = "shared_expert_gate"
