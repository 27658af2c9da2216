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
from moelora_core.layer_spec import LoRALayerSpec


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
    base_quant: str = "none"
    weight_block: tuple[int, int] | None = None
    modules_to_not_convert: tuple[str, ...] = ()

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def dense_shapes(self) -> dict[str, tuple[int, int]]:
        """moelora dense module → (in_features, out_features): the attention projections and, for a
        model with a shared expert, its gate / up (H → Is) and down (Is → H) projections."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        h = self.hidden_size
        shapes = {"q": (h, q_out), "k": (h, kv_out), "v": (h, kv_out), "o": (q_out, h)}
        if self.shared_expert_intermediate_size is not None:
            si = self.shared_expert_intermediate_size
            shapes.update({"shared_gate": (h, si), "shared_up": (h, si), "shared_down": (si, h)})
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
