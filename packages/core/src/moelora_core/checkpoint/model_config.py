"""The typed model config the readers produce from ``config.json`` (one class for every family)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora_core.checkpoint.errors import CheckpointFormatError, UnsupportedModelError, UnsupportedQuantizationError
from moelora_core.checkpoint.families import FAMILIES, Family
from moelora_core.errors import InvalidFieldError
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.routing import GroupLimitedRouting

#: RoPE types of ``rope_parameters`` that DeepSeek-V3's MLA is served with (the released configs use YaRN).
MLA_ROPE_TYPES: tuple[str, ...] = ("default", "yarn")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V3's multi-head latent attention (DESIGN.md §1; transformers ``DeepseekV3Attention``).

    Attributes:
        q_lora_rank: the query's low rank (``q_a_proj`` H → q_lora_rank → ``q_b_proj``), or None
            (one ``q_proj``).
        kv_lora_rank: the compressed KV width (``kv_a_proj_with_mqa`` H → kv_lora_rank + rope dim).
        qk_nope_head_dim, qk_rope_head_dim: the per-head query/key split (RoPE on the second part;
            the rope part of the key is one head shared by all).
        v_head_dim: the value head width.
        rope_interleave: RoPE on interleaved pairs (x_2i, x_2i+1), as released checkpoints.
        rope_parameters: ``rope_parameters`` as (key, value) pairs, sorted ("rope_type" "default" or
            "yarn" with "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim").
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    rope_parameters: tuple[tuple[str, object], ...]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope(self) -> dict[str, object]:
        """``rope_parameters`` as a dict."""
        return dict(self.rope_parameters)


@dataclass(frozen=True)
class MoEModelConfig:
    """What moelora needs to know about a decoder-only MoE model.

    Attributes:
        family: the :class:`~moelora_core.checkpoint.families.Family`.
        architecture: ``architectures[0]`` of config.json (None when absent).
        num_layers: decoder layers, every one an MoE layer.
        hidden_size: H.
        moe_intermediate_size: I, one expert's gate/up width.
        num_experts: E, routed experts per layer.
        top_k: experts per token.
        num_attention_heads, num_key_value_heads, head_dim: attention geometry
            (q: H → heads·head_dim; k, v: H → kv_heads·head_dim; o: heads·head_dim → H).
        vocab_size: rows of the embedding and the LM head.
        norm_topk_prob: renormalise the top-k router weights (always True for Mixtral).
        rms_norm_eps: ε of every RMSNorm.
        rope_theta: RoPE base.
        tie_word_embeddings: the LM head is the embedding matrix.
        clip_qkv: OLMoE's clamp of q/k/v outputs (None = none).
        torch_dtype: the dtype config.json declares ("float32", ...), None when absent.
        shared_expert_intermediate_size: Is, the width of the dense shared expert (Qwen2-MoE's
            ``shared_expert_intermediate_size``); None for a family without one.
        qkv_bias: the q, k and v projections have biases (Qwen2-MoE's ``qkv_bias``, true when the
            key is absent, as in transformers; GPT-OSS's ``attention_bias``).
        o_bias: the o projection has a bias too (GPT-OSS's ``attention_bias``).
        layer_types: per layer "full_attention" or "sliding_attention" (GPT-OSS), else None.
        sliding_window: the window of the "sliding_attention" layers (GPT-OSS), else None.
        mla: DeepSeek-V3's attention geometry (:class:`MLAConfig`), else None; ``head_dim`` is then
            its ``qk_head_dim``.
        first_k_dense_replace: the first layers that are dense MLPs (DeepSeek-V3), else 0.
        dense_intermediate_size: their width (DeepSeek-V3's ``intermediate_size``), else None.
        routing: DeepSeek-V3's group-limited routing, else None (softmax top-k).
        base_quant: "none", or "fp8_block" for a checkpoint with ``quantization_config``
            ``{"quant_method": "fp8", "weight_block_size": [bn, bk], "activation_scheme": "dynamic"}``
            (DESIGN.md §1, "Quantized base"; :func:`read_quantization`).
        weight_block: (bn, bk) of an fp8 block-scaled checkpoint, else None.
        modules_to_not_convert: the ``quantization_config``'s module names kept unquantized.
    """

    family: Family
    architecture: str | None
    num_layers: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    clip_qkv: float | None = None
    torch_dtype: str | None = None
    shared_expert_intermediate_size: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    mla: MLAConfig | None = None
    first_k_dense_replace: int = 0
    dense_intermediate_size: int | None = None
    routing: GroupLimitedRouting | None = None
    base_quant: str = "none"
    weight_block: tuple[int, int] | None = None
    modules_to_not_convert: tuple[str, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has an MoE block (DeepSeek-V3's first layers do not)."""
        return layer >= self.first_k_dense_replace

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def dense_shapes(self) -> dict[str, tuple[int, int]]:
        """moelora dense module → (in_features, out_features): the attention projections and, for a
        model with a shared expert, its gate / up (H → Is) and down (Is → H) projections; DeepSeek-V3:
        the MLA projections and the dense MLP's (every layer's spec holds them all; a dense layer's
        pool simply never holds the shared expert's, nor an MoE layer's the dense MLP's)."""
        if self.mla is not None:
            return self._mla_dense_shapes()
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        h = self.hidden_size
        shapes = {"q": (h, q_out), "k": (h, kv_out), "v": (h, kv_out), "o": (q_out, h)}
        if self.shared_expert_intermediate_size is not None:
            si = self.shared_expert_intermediate_size
            shapes.update({"shared_gate": (h, si), "shared_up": (h, si), "shared_down": (si, h)})
        return shapes

    def _mla_dense_shapes(self) -> dict[str, tuple[int, int]]:
        m, h, nh = self.mla, self.hidden_size, self.num_attention_heads
        shapes: dict[str, tuple[int, int]] = {}
        if m.q_lora_rank is None:
            shapes["q"] = (h, nh * m.qk_head_dim)
        else:
            shapes.update({"q_a": (h, m.q_lora_rank), "q_b": (m.q_lora_rank, nh * m.qk_head_dim)})
        shapes.update({"kv_a": (h, m.kv_lora_rank + m.qk_rope_head_dim),
                       "kv_b": (m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim)),
                       "o": (nh * m.v_head_dim, h)})
        if self.first_k_dense_replace < self.num_layers:
            si = self.shared_expert_intermediate_size
            shapes.update({"shared_gate": (h, si), "shared_up": (h, si), "shared_down": (si, h)})
        if self.first_k_dense_replace > 0:
            di = self.dense_intermediate_size
            shapes.update({"dense_gate": (h, di), "dense_up": (h, di), "dense_down": (di, h)})
        return shapes

    def layer_spec(
        self,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LoRALayerSpec:
        """The ``LoRALayerSpec`` of one decoder layer of this model (every layer is alike)."""
        return LoRALayerSpec(
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            dense_shapes=self.dense_shapes,
            max_loras=max_loras,
            max_rank=max_rank,
            dtype=dtype,
            device=torch.device(device),
            base_quant=self.base_quant,
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, object], *, path: object = "<config>") -> MoEModelConfig:
        """Parse a transformers ``config.json`` dict.

        Raises:
            UnsupportedModelError: unknown ``model_type``; a Qwen3-MoE or Qwen2-MoE with dense MLP
                layers (``mlp_only_layers`` / ``decoder_sparse_step``); ``attention_bias`` (o too)
                or MLP biases (Qwen2-MoE's q/k/v-only ``qkv_bias`` is read); an activation other
                than SiLU.
            CheckpointFormatError: a required field is missing or not a positive int.
            UnsupportedQuantizationError: see :func:`read_quantization`.
        """
        model_type = raw.get("model_type")
        family = FAMILIES.get(str(model_type))
        if family is None:
            raise UnsupportedModelError(
                path, "config.json model_type", "unsupported model family",
                expected=f"one of {sorted(FAMILIES)}", found=repr(model_type),
            )

        def positive(key: str, value: object = None) -> int:
            value = raw.get(key) if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointFormatError(path, f"config.json {key}", "must be an int >= 1", found=repr(value))
            return value

        experts_key = next((k for k in family.experts_keys if raw.get(k) is not None), family.experts_keys[0])
        hidden = positive("hidden_size")
        heads = positive("num_attention_heads")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise CheckpointFormatError(path, "config.json head_dim", "absent and hidden_size % heads != 0")
            head_dim = hidden // heads
        if model_type in ("qwen3_moe", "qwen2_moe"):
            sparse_step = raw.get("decoder_sparse_step", 1)
            if raw.get("mlp_only_layers") or sparse_step != 1:
                raise UnsupportedModelError(
                    path, "config.json mlp_only_layers / decoder_sparse_step",
                    "dense MLP layers are not supported (every layer must be an MoE layer)",
                    expected="[] and 1", found=f"{raw.get('mlp_only_layers')!r} and {sparse_step!r}",
                )
        gpt_oss = model_type == "gpt_oss"
        for key in ("mlp_bias",) if gpt_oss else ("attention_bias", "mlp_bias"):
            if raw.get(key):
                raise UnsupportedModelError(path, f"config.json {key}", "biases are not supported", found=True)
        # Qwen2MoeConfig's qkv_bias defaults to True (q/k/v biases, as Qwen1.5-MoE ships them): an
        # absent key means biases too.
        qkv_bias = bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else False
        # GptOssConfig's attention_bias defaults to True: q, k, v and o all have biases.
        o_bias = gpt_oss and bool(raw.get("attention_bias", True))
        qkv_bias = qkv_bias or o_bias
        layer_types, window = None, None
        if gpt_oss:
            layer_types, window = _gpt_oss_attention(raw, path, positive("num_hidden_layers"))
        if family.attention == "mla":
            return _deepseek_v3(cls, family, raw, path, positive)
        shared_inter = positive("shared_expert_intermediate_size") if family.shared_expert else None
        act = raw.get("hidden_act", "silu")
        # GPT-OSS's experts ignore hidden_act (GptOssExperts hard-codes its clamped SwiGLU)
        if not gpt_oss and act not in ("silu", "swish"):
            raise UnsupportedModelError(path, "config.json hidden_act", "experts must use SiLU",
                                        expected="'silu'", found=repr(act))
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0)) if isinstance(rope, Mapping) else 10000.0
        eps = float(raw.get("rms_norm_eps", 1e-6))
        if not math.isfinite(eps) or eps <= 0:
            raise CheckpointFormatError(path, "config.json rms_norm_eps", "must be a positive float", found=eps)
        archs = raw.get("architectures") or [None]
        num_experts = positive(experts_key)
        top_k = positive("num_experts_per_tok")
        if top_k > num_experts:
            raise CheckpointFormatError(path, "config.json num_experts_per_tok", "exceeds the number of experts",
                                        expected=f"<= {num_experts}", found=top_k)
        clip = raw.get("clip_qkv")
        base_quant, block, not_convert = read_quantization(raw.get("quantization_config"), path)
        return cls(
            family=family,
            architecture=archs[0],
            num_layers=positive("num_hidden_layers"),
            hidden_size=hidden,
            moe_intermediate_size=positive(family.intermediate_key),
            num_experts=num_experts,
            top_k=top_k,
            num_attention_heads=heads,
            num_key_value_heads=positive("num_key_value_heads", raw.get("num_key_value_heads") or heads),
            head_dim=positive("head_dim", head_dim),
            vocab_size=positive("vocab_size"),
            norm_topk_prob=True if family.always_renormalize else bool(raw.get("norm_topk_prob", False)),
            rms_norm_eps=eps,
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            clip_qkv=None if clip is None else float(clip),
            torch_dtype=raw.get("dtype", raw.get("torch_dtype")),
            shared_expert_intermediate_size=shared_inter,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            layer_types=layer_types,
            sliding_window=window,
            base_quant=base_quant,
            weight_block=block,
            modules_to_not_convert=not_convert,
        )


def _deepseek_v3(cls, family: Family, raw: Mapping[str, object], path: object, positive) -> MoEModelConfig:
    """A DeepSeek-V3 config.json (transformers 5.17 ``DeepseekV3Config``; its defaults where a key is
    absent).

    Raises:
        UnsupportedModelError: ``attention_bias`` / ``mlp_bias``, an activation other than SiLU, a
            ``rope_type`` outside :data:`MLA_ROPE_TYPES`.
        CheckpointFormatError: a size that is not a positive int; groups that do not split the
            experts or hold fewer than top_k of them.
        UnsupportedQuantizationError: see :func:`read_quantization`.
    """
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UnsupportedModelError(path, f"config.json {key}", "biases are not supported", found=True)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(path, "config.json hidden_act", "experts must use SiLU", expected="'silu'",
                                    found=repr(act))
    rope = raw.get("rope_parameters") or {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    if not isinstance(rope, Mapping):
        raise CheckpointFormatError(path, "config.json rope_parameters", "must be a JSON object", found=repr(rope))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in MLA_ROPE_TYPES:
        raise UnsupportedModelError(path, "config.json rope_parameters.rope_type", "RoPE type not served",
                                    expected=f"one of {MLA_ROPE_TYPES}", found=repr(rope_type))
    q_lora = raw.get("q_lora_rank", 1536)
    mla = MLAConfig(
        q_lora_rank=None if q_lora is None else positive("q_lora_rank", q_lora),
        kv_lora_rank=positive("kv_lora_rank"),
        qk_nope_head_dim=positive("qk_nope_head_dim"),
        qk_rope_head_dim=positive("qk_rope_head_dim"),
        v_head_dim=positive("v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        rope_parameters=tuple(sorted({**rope, "rope_type": rope_type}.items())),
    )
    if mla.qk_rope_head_dim % 2:
        raise CheckpointFormatError(path, "config.json qk_rope_head_dim", "must be even (RoPE rotates pairs)",
                                    found=mla.qk_rope_head_dim)
    layers = positive("num_hidden_layers")
    first_dense = raw.get("first_k_dense_replace", 3)
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or not 0 <= first_dense <= layers:
        raise CheckpointFormatError(path, "config.json first_k_dense_replace", f"must be an int in [0, {layers}]",
                                    found=repr(first_dense))
    num_experts = positive("n_routed_experts", raw.get("n_routed_experts") or raw.get("num_local_experts"))
    top_k = positive("num_experts_per_tok")
    inter = positive("moe_intermediate_size")
    try:
        routing = GroupLimitedRouting(positive("n_group", raw.get("n_group", 8)),
                                      positive("topk_group", raw.get("topk_group", 4)),
                                      float(raw.get("routed_scaling_factor", 2.5)))
        routing.check_experts(num_experts, top_k)
    except InvalidFieldError as exc:
        raise CheckpointFormatError(path, f"config.json {exc.field}", exc.problem) from None
    eps = float(raw.get("rms_norm_eps", 1e-6))
    if not math.isfinite(eps) or eps <= 0:
        raise CheckpointFormatError(path, "config.json rms_norm_eps", "must be a positive float", found=eps)
    heads = positive("num_attention_heads")
    # the released checkpoints are fp8 block-scaled (block 128): read as every family's (DESIGN.md §1)
    base_quant, block, not_convert = read_quantization(raw.get("quantization_config"), path)
    return cls(
        family=family,
        architecture=(raw.get("architectures") or [None])[0],
        num_layers=layers,
        hidden_size=positive("hidden_size"),
        moe_intermediate_size=inter,
        num_experts=num_experts,
        top_k=top_k,
        num_attention_heads=heads,
        num_key_value_heads=heads,  # MLA: every head reads the one latent
        head_dim=mla.qk_head_dim,
        vocab_size=positive("vocab_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        rms_norm_eps=eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=raw.get("dtype", raw.get("torch_dtype")),
        shared_expert_intermediate_size=inter * positive("n_shared_experts", raw.get("n_shared_experts", 1)),
        mla=mla,
        first_k_dense_replace=first_dense,
        dense_intermediate_size=positive("intermediate_size") if first_dense else None,
        routing=routing,
        base_quant=base_quant,
        weight_block=block,
        modules_to_not_convert=not_convert,
    )


#: The one quantized format served (DESIGN.md §1): HF's fine-grained fp8 (Qwen3-FP8, DeepSeek-V3).
FP8_QUANT_METHOD = "fp8"


def read_quantization(qc: object, path: object) -> tuple[str, tuple[int, int] | None, tuple[str, ...]]:
    """(base_quant, weight_block, modules_to_not_convert) of config.json's ``quantization_config``
    as HF writes it: absent → ("none", None, ()); ``{"quant_method": "fp8", "weight_block_size":
    [bn, bk], "activation_scheme": "dynamic"}`` (``fmt`` "e4m3" where given) → ("fp8_block", (bn, bk),
    its ``modules_to_not_convert``).

    Raises:
        UnsupportedQuantizationError: another ``quant_method`` (MXFP4 named as GPT-OSS's released
            format), per-tensor fp8 (no ``weight_block_size``) or a malformed one, static activation
            scales, an fp8 format other than e4m3, ``dequantize`` set (moelora reads fp8 as stored).
    """
    if qc is None:
        return "none", None, ()
    where = "config.json quantization_config"
    if not isinstance(qc, Mapping):
        raise UnsupportedQuantizationError(path, where, "must be a JSON object", found=repr(qc))
    method = qc.get("quant_method")
    if method != FP8_QUANT_METHOD:
        problem = ("MXFP4 (GPT-OSS's released checkpoints) is not served: only fp8 block-scaled bases are"
                   if str(method).lower() == "mxfp4" else "only fp8 block-scaled bases are served")
        raise UnsupportedQuantizationError(path, f"{where}.quant_method", problem, expected="'fp8'",
                                           found=repr(method))
    block = qc.get("weight_block_size")
    if block is None:
        raise UnsupportedQuantizationError(path, f"{where}.weight_block_size", "per-tensor fp8 is not served: "
                                           "the weights must be block-scaled", expected="[bn, bk]", found=None)
    if not isinstance(block, list) or len(block) != 2 or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block):
        raise UnsupportedQuantizationError(path, f"{where}.weight_block_size", "must be two positive ints",
                                           expected="[bn, bk]", found=repr(block))
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedQuantizationError(path, f"{where}.activation_scheme", "static activation scales are not "
                                           "served (activations are quantized per token per K-group)",
                                           expected="'dynamic'", found=repr(scheme))
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(path, f"{where}.fmt", "only float8 e4m3 weights are served",
                                           expected="'e4m3'", found=repr(fmt))
    if qc.get("dequantize"):
        raise UnsupportedQuantizationError(path, f"{where}.dequantize", "a dequantizing config is not served",
                                           expected="false", found=True)
    not_convert = qc.get("modules_to_not_convert") or []
    if not isinstance(not_convert, list) or not all(isinstance(m, str) for m in not_convert):
        raise UnsupportedQuantizationError(path, f"{where}.modules_to_not_convert", "must be a list of module "
                                           "names", found=repr(not_convert))
    return "fp8_block", (block[0], block[1]), tuple(not_convert)


def _gpt_oss_attention(raw: Mapping[str, object], path: object, layers: int) -> tuple[tuple[str, ...], int]:
    """(layer_types, sliding_window) of a GPT-OSS config (GptOssConfig's default: sliding on even layers).

    Raises:
        CheckpointFormatError: a layer type other than the two, a list of the wrong length, a window < 1.
    """
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise CheckpointFormatError(path, "config.json layer_types", f"must list one of {kinds} per layer",
                                    expected=layers, found=repr(types))
    window = raw.get("sliding_window", 128)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointFormatError(path, "config.json sliding_window", "must be an int >= 1", found=repr(window))
    return tuple(types), window


def read_model_config(path: str | Path) -> MoEModelConfig:
    """Read ``path/config.json`` (or the file ``path`` itself) into a :class:`MoEModelConfig`.

    Raises:
        CheckpointFormatError: the file is missing or not valid JSON (or a field is malformed).
        UnsupportedModelError: see :meth:`MoEModelConfig.from_dict`.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointFormatError(path, "config.json", "not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(path, "config.json", f"not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(path, "config.json", "must hold a JSON object")
    return MoEModelConfig.from_dict(raw, path=path)
