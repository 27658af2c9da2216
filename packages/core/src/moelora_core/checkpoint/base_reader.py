"""Read a Hugging Face MoE checkpoint (config.json + safetensors) into moelora's layout.

Formats read (transformers 5.17; see :mod:`moelora_core.checkpoint.families`):

- per-expert keys as ``save_pretrained`` writes them: ``mlp.experts.{e}.gate_proj/up_proj/
  down_proj.weight`` (Qwen3-MoE, OLMoE), ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (Mixtral);
- the fused 3-D form: ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
  ``mlp.experts.down_proj`` [E, H, I];
- q/k/v biases ``self_attn.{q,k,v}_proj.bias`` where the config has ``qkv_bias`` (Qwen2-MoE);
- GPT-OSS (:mod:`.gpt_oss`): ``mlp.experts.gate_up_proj`` [E, H, 2I] (gate/up columns interleaved)
  with ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H] with ``down_proj_bias`` [E, H],
  ``mlp.router.weight`` / ``.bias``, q/k/v/o biases and ``self_attn.sinks`` [heads]; converted to
  the halves layout with the biases in ``MoEBaseWeights``;
- Qwen2-MoE's shared expert beside either form: ``mlp.shared_expert.{gate,up,down}_proj.weight``
  ([Is, H], [Is, H], [H, Is]) and its sigmoid gate ``mlp.shared_expert_gate.weight`` [1, H];
- DeepSeek-V3 (DESIGN.md §1): MLA ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or
  ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; on layers
  ``l < first_k_dense_replace`` a dense MLP ``mlp.{gate,up,down}_proj`` and no experts; on the others
  the experts (either form), the router ``mlp.gate.weight`` with its ``e_score_correction_bias`` [E],
  and the ungated shared experts ``mlp.shared_experts.{gate,up,down}_proj``.
- fp8 block-scaled checkpoints (``quantization_config`` ``quant_method: fp8`` with
  ``weight_block_size`` [bn, bk]; DESIGN.md §1, "Quantized base"): per-expert expert weights and the
  dense projections (q/k/v/o, the shared expert's; DeepSeek-V3's MLA projections, shared experts and
  dense MLP) may be stored float8_e4m3fn, each with its
  ``weight_scale_inv`` fp32 [⌈out/bn⌉, ⌈in/bk⌉]; modules in ``modules_to_not_convert``, routers,
  norms, embeddings and the LM head stay unquantized. The experts of an fp8 checkpoint are all fp8.
  Edge blocks may be partial (the released DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` at block 128).
  fp8 tensors and their scales are never cast to ``dtype``. Refused by name: an fp8 tensor where the
  format has none or in a checkpoint without the config (``UnsupportedQuantizationError``), fused
  3-D fp8 expert stacks, a missing (``MissingTensorError``) or mis-shaped (``CheckpointShapeError``)
  scale.

The orientation comes from the format, never from the shapes: a tensor whose shape is not exactly
the one the config implies is refused (with H != 2I a transposed expert stack fails loudly; with
H == 2I the format alone decides). Every tensor of the checkpoint must be consumed: keys the layout
has no place for (biases, a shared expert in a family without one, extra layers) are refused rather
than ignored.

Reading is lazy: :class:`MoECheckpoint` validates every header on open and reads tensor data one
layer at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.checkpoint.errors import (
    CheckpointFormatError,
    CheckpointShapeError,
    MissingTensorError,
    UnsupportedModelError,
    UnsupportedQuantizationError,
)
from moelora_core.checkpoint.gpt_oss import gpt_oss_experts
from moelora_core.checkpoint.key_names import describe_non_canonical, non_canonical
from moelora_core.checkpoint.layout import DecoderLayerWeights, MLAWeights, ModelWeights
from moelora_core.checkpoint.model_config import MoEModelConfig, read_model_config
from moelora_core.checkpoint.tensor_source import TensorSource
from moelora_core.fp8_block import scale_grid
from moelora_core.layer_spec import DENSE_MLP_MODULES, SHARED_EXPERT_MODULES
from moelora_core.shared_expert import SharedExpertWeights, dense_mlp

_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_FP8 = "float8_e4m3fn"
_SCALE = ".weight_scale_inv"


class MoECheckpoint:
    """A base checkpoint opened for reading.

    Args:
        path: the checkpoint directory (``config.json`` and ``model.safetensors`` or shards).
        dtype: cast every tensor to this dtype; None keeps the stored dtype.

    Attributes:
        config: the typed model config.
        expert_format: per layer, "per_expert" or "fused" (as stored).

    Raises (on open):
        CheckpointFormatError: missing/unreadable files, a duplicated key, a key with a
            non-canonical index (``experts.00``, non-ASCII digits; see :mod:`.key_names`), a
            non-floating tensor.
        UnsupportedModelError: see :meth:`MoEModelConfig.from_dict`.
        MissingTensorError: a required tensor is absent.
        CheckpointShapeError: a tensor's shape differs from the config's (expected vs found).
    """

    def __init__(self, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self.config: MoEModelConfig = read_model_config(self.path)
        self._src = TensorSource.from_directory(
            self.path, stem="model", error=lambda subject, problem: CheckpointFormatError(self.path, subject, problem)
        )
        self._layout: dict[str, tuple[int, ...]] = {}
        #: weight keys stored fp8 (each with its ``weight_scale_inv``), kept as stored by ``tensor``.
        self._fp8: set[str] = set()
        self.expert_format: list[str] = []
        self._plan()

    # --- planning: every key, its expected shape ------------------------------------------------

    def _expect(self, key: str, shape: tuple[int, ...], *, quantizable: bool = False) -> None:
        """Plan ``key`` of ``shape``; a ``quantizable`` linear weight of an fp8 checkpoint may be stored
        fp8 with its block scales (checked here)."""
        if key not in self._src:
            raise MissingTensorError(self.path, key, "required tensor is missing", expected=shape, found="no such key")
        found = self._src.shape(key)
        if found != shape:
            raise CheckpointShapeError(self.path, key, "wrong shape", expected=shape, found=found)
        dtype = self._src.dtype_name(key)
        if dtype == _FP8:
            self._expect_fp8(key, shape, quantizable)
        elif dtype not in _FLOAT_DTYPES:
            raise CheckpointFormatError(self.path, key, "not a floating-point tensor",
                                        expected="/".join(_FLOAT_DTYPES), found=dtype)
        self._layout[key] = shape

    def _expect_fp8(self, key: str, shape: tuple[int, ...], quantizable: bool) -> None:
        c = self.config
        if c.weight_block is None:
            raise UnsupportedQuantizationError(self.path, key, "an fp8 tensor in a checkpoint without an fp8 "
                                               "quantization_config", expected="/".join(_FLOAT_DTYPES), found=_FP8)
        module = key.removesuffix(".weight")
        if not quantizable or not key.endswith(".weight") or len(shape) != 2:
            raise UnsupportedQuantizationError(self.path, key, "stored fp8 where the format has no fp8 tensor "
                                               "(only expert weights and dense projections are quantized)",
                                               expected="/".join(_FLOAT_DTYPES), found=_FP8)
        if any(m in module for m in c.modules_to_not_convert):
            raise UnsupportedQuantizationError(self.path, key, "stored fp8 but listed in modules_to_not_convert",
                                               expected="/".join(_FLOAT_DTYPES), found=_FP8)
        scale_key, grid = module + _SCALE, scale_grid(shape[0], shape[1], c.weight_block)
        if scale_key not in self._src:
            raise MissingTensorError(self.path, scale_key, "the block scales of an fp8 weight are missing",
                                     expected=grid, found="no such key")
        if self._src.shape(scale_key) != grid:
            raise CheckpointShapeError(self.path, scale_key, f"wrong scale grid for a {shape} weight at block "
                                       f"{list(c.weight_block)}", expected=grid, found=self._src.shape(scale_key))
        if self._src.dtype_name(scale_key) != "float32":
            raise CheckpointFormatError(self.path, scale_key, "block scales must be fp32", expected="float32",
                                        found=self._src.dtype_name(scale_key))
        self._fp8.add(key)
        self._layout[scale_key] = grid

    def _moe_block(self, layer: int) -> tuple[str, str]:
        """(block name, "per_expert" | "fused") of ``layer``'s MoE block, as stored."""
        fam = self.config.family
        prefix = f"model.layers.{layer}"
        if fam.expert_biases:  # GPT-OSS ships the fused form only
            return "mlp", "fused"
        if f"{prefix}.mlp.experts.gate_up_proj" in self._src or f"{prefix}.mlp.experts.down_proj" in self._src:
            return "mlp", "fused"
        return fam.expert_block, "per_expert"

    def _plan(self) -> None:
        c = self.config
        H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts  # noqa: E741
        dense = c.dense_shapes
        keys = self._src.keys()
        if bad := non_canonical(keys):  # before _expect, which would report the canonical key missing
            shown, problem = describe_non_canonical(bad, present=set(keys))
            raise CheckpointFormatError(self.path, shown, problem)
        self._expect("model.embed_tokens.weight", (c.vocab_size, H))
        self._expect("model.norm.weight", (H,))
        if "lm_head.weight" in self._src or not c.tie_word_embeddings:
            self._expect("lm_head.weight", (c.vocab_size, H))
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}"
            if c.mla is not None:
                self._plan_deepseek_layer(layer)
                continue
            for module, leaf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
                fin, fout = dense[module]
                self._expect(f"{p}.self_attn.{leaf}.weight", (fout, fin), quantizable=True)
                if c.qkv_bias and (module != "o" or c.o_bias):
                    self._expect(f"{p}.self_attn.{leaf}.bias", (fout,))
            if c.family.attention_sinks:
                self._expect(f"{p}.self_attn.sinks", (c.num_attention_heads,))
            if c.family.qk_norm == "per_head":
                self._expect(f"{p}.self_attn.q_norm.weight", (c.head_dim,))
                self._expect(f"{p}.self_attn.k_norm.weight", (c.head_dim,))
            elif c.family.qk_norm == "full":
                self._expect(f"{p}.self_attn.q_norm.weight", (dense["q"][1],))
                self._expect(f"{p}.self_attn.k_norm.weight", (dense["k"][1],))
            self._expect(f"{p}.input_layernorm.weight", (H,))
            self._expect(f"{p}.post_attention_layernorm.weight", (H,))
            block, form = self._moe_block(layer)
            self.expert_format.append(form)
            self._expect(f"{p}.{block}.{c.family.router_leaf}.weight", (E, H))
            if c.family.expert_biases:  # GPT-OSS: x @ W layout, interleaved gate/up, biases
                self._expect(f"{p}.{block}.{c.family.router_leaf}.bias", (E,))
                self._expect(f"{p}.mlp.experts.gate_up_proj", (E, H, 2 * I))
                self._expect(f"{p}.mlp.experts.gate_up_proj_bias", (E, 2 * I))
                self._expect(f"{p}.mlp.experts.down_proj", (E, I, H))
                self._expect(f"{p}.mlp.experts.down_proj_bias", (E, H))
            elif form == "fused":
                # fused 3-D fp8 stacks are refused by _expect (not quantizable here: no 2-D scale grid)
                self._expect(f"{p}.mlp.experts.gate_up_proj", (E, 2 * I, H))
                self._expect(f"{p}.mlp.experts.down_proj", (E, H, I))
                if c.weight_block is not None:
                    raise UnsupportedQuantizationError(self.path, f"{p}.mlp.experts.gate_up_proj", "fused 3-D "
                                                       "expert stacks in an fp8 checkpoint are not served (per-expert "
                                                       "fp8 weights with their scales are)")
            else:
                g, u, d = c.family.expert_leaves
                for e in range(E):
                    self._expect(f"{p}.{block}.experts.{e}.{g}.weight", (I, H), quantizable=True)
                    self._expect(f"{p}.{block}.experts.{e}.{u}.weight", (I, H), quantizable=True)
                    self._expect(f"{p}.{block}.experts.{e}.{d}.weight", (H, I), quantizable=True)
                self._check_fp8_experts(layer, block)
            if c.family.shared_expert:
                for name, (key, shape) in self._shared_keys(layer).items():
                    self._expect(key, shape, quantizable=name != "gate")
        extra = [k for k in self._src.keys() if k not in self._layout]
        if extra:
            shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
            raise UnsupportedModelError(
                self.path, shown, f"{len(extra)} tensor(s) that the {c.family.display} layout has no place for "
                "(biases, shared experts, extra layers?)",
            )

    def _plan_deepseek_layer(self, layer: int) -> None:
        c = self.config
        H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts  # noqa: E741
        p = f"model.layers.{layer}"
        # fp8 checkpoints store the MLA projections, the dense MLP and the shared and routed experts
        # fp8 (the released DeepSeek-V3); its norms, routers and correction biases never are.
        for name, (key, shape) in self._mla_keys(layer).items():
            self._expect(key, shape, quantizable=not name.endswith("layernorm"))
        self._expect(f"{p}.input_layernorm.weight", (H,))
        self._expect(f"{p}.post_attention_layernorm.weight", (H,))
        if not c.is_moe_layer(layer):
            self.expert_format.append("dense")
            for key, shape in self._mlp_keys(f"{p}.mlp", c.dense_intermediate_size).values():
                self._expect(key, shape, quantizable=True)
            return
        _, form = self._moe_block(layer)
        self.expert_format.append(form)
        self._expect(f"{p}.mlp.gate.weight", (E, H))
        self._expect(f"{p}.mlp.gate.e_score_correction_bias", (E,))
        if form == "fused":
            self._expect(f"{p}.mlp.experts.gate_up_proj", (E, 2 * I, H))
            self._expect(f"{p}.mlp.experts.down_proj", (E, H, I))
            if c.weight_block is not None:
                raise UnsupportedQuantizationError(self.path, f"{p}.mlp.experts.gate_up_proj", "fused 3-D "
                                                   "expert stacks in an fp8 checkpoint are not served (per-expert "
                                                   "fp8 weights with their scales are)")
        else:
            for e in range(E):
                self._expect(f"{p}.mlp.experts.{e}.gate_proj.weight", (I, H), quantizable=True)
                self._expect(f"{p}.mlp.experts.{e}.up_proj.weight", (I, H), quantizable=True)
                self._expect(f"{p}.mlp.experts.{e}.down_proj.weight", (H, I), quantizable=True)
            self._check_fp8_experts(layer, "mlp")
        for key, shape in self._mlp_keys(f"{p}.mlp.shared_experts", c.shared_expert_intermediate_size).values():
            self._expect(key, shape, quantizable=True)

    def _mla_keys(self, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """MLAWeights field (and "o_proj") → (key, shape) of ``layer``'s MLA attention (DeepSeek-V3)."""
        c, m = self.config, self.config.mla
        shapes = c.dense_shapes
        a = f"model.layers.{layer}.self_attn"
        keys: dict[str, tuple[str, tuple[int, ...]]] = {}
        if m.q_lora_rank is None:
            keys["q_proj"] = (f"{a}.q_proj.weight", shapes["q"][::-1])
        else:
            keys["q_a_proj"] = (f"{a}.q_a_proj.weight", shapes["q_a"][::-1])
            keys["q_a_layernorm"] = (f"{a}.q_a_layernorm.weight", (m.q_lora_rank,))
            keys["q_b_proj"] = (f"{a}.q_b_proj.weight", shapes["q_b"][::-1])
        keys["kv_a_proj"] = (f"{a}.kv_a_proj_with_mqa.weight", shapes["kv_a"][::-1])
        keys["kv_a_layernorm"] = (f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,))
        keys["kv_b_proj"] = (f"{a}.kv_b_proj.weight", shapes["kv_b"][::-1])
        keys["o_proj"] = (f"{a}.o_proj.weight", shapes["o"][::-1])
        return keys

    def _mlp_keys(self, prefix: str, width: int) -> dict[str, tuple[str, tuple[int, int]]]:
        """SharedExpertWeights field → (key, shape) of an ungated SwiGLU MLP under ``prefix``."""
        H = self.config.hidden_size
        return {"gate_proj": (f"{prefix}.gate_proj.weight", (width, H)),
                "up_proj": (f"{prefix}.up_proj.weight", (width, H)),
                "down_proj": (f"{prefix}.down_proj.weight", (H, width))}

    def _check_fp8_experts(self, layer: int, block: str) -> None:
        """An fp8 checkpoint's experts are all fp8 (MoEBaseWeights holds one base_quant per block)."""
        if self.config.weight_block is None:
            return
        keys = [k for k in self._layout if k.startswith(f"model.layers.{layer}.{block}.experts.")
                and k.endswith(".weight")]
        plain = [k for k in keys if k not in self._fp8]
        if plain:
            raise UnsupportedQuantizationError(self.path, plain[0], f"an fp8 checkpoint with {len(plain)} expert "
                                               "weight(s) not stored fp8 (every expert weight must be)",
                                               expected=_FP8, found=self._src.dtype_name(plain[0]))

    def _shared_keys(self, layer: int) -> dict[str, tuple[str, tuple[int, int]]]:
        """SharedExpertWeights field → (key, shape) of ``layer``'s shared expert (Qwen2-MoE)."""
        c = self.config
        H, si = c.hidden_size, c.shared_expert_intermediate_size
        p = f"model.layers.{layer}.mlp"
        return {"gate_proj": (f"{p}.shared_expert.gate_proj.weight", (si, H)),
                "up_proj": (f"{p}.shared_expert.up_proj.weight", (si, H)),
                "down_proj": (f"{p}.shared_expert.down_proj.weight", (H, si)),
                "gate": (f"{p}.shared_expert_gate.weight", (1, H))}

    # --- reading ---------------------------------------------------------------------------------

    def tensor(self, key: str) -> torch.Tensor:
        """One tensor by its checkpoint key, cast to ``dtype`` (validated on open)."""
        if key not in self._layout:
            raise MissingTensorError(self.path, key, "not a tensor of this checkpoint's layout")
        t = self._src.get(key)
        if key in self._fp8 or key.endswith(_SCALE):  # fp8 weights and their fp32 scales stay as stored
            return t
        return t if self.dtype is None else t.to(self.dtype)

    def scale(self, key: str) -> torch.Tensor | None:
        """The ``weight_scale_inv`` [⌈out/bn⌉, ⌈in/bk⌉] fp32 of weight ``key`` if it is stored fp8, else None."""
        return self.tensor(key.removesuffix(".weight") + _SCALE) if key in self._fp8 else None

    def moe(self, layer: int) -> MoEBaseWeights | None:
        """Layer ``layer``'s MoE block: w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I],
        router [E, H]; GPT-OSS also b_gate_up [E, 2I] (halves), b_down [E, H], router_bias [E] and
        its activation; DeepSeek-V3 its routing and correction bias [E], and None for a dense layer.

        Raises:
            IndexError: ``layer`` outside ``[0, num_layers)``.
        """
        self._check_layer(layer)
        c = self.config
        if not c.is_moe_layer(layer):
            return None
        p = f"model.layers.{layer}"
        block, form = self._moe_block(layer)
        fam = c.family
        router = self.tensor(f"{p}.{block}.{fam.router_leaf}.weight")
        if fam.expert_biases:
            ex = f"{p}.mlp.experts"
            w_gate_up, b_gate_up, w_down, b_down = gpt_oss_experts(
                self.tensor(f"{ex}.gate_up_proj"), self.tensor(f"{ex}.gate_up_proj_bias"),
                self.tensor(f"{ex}.down_proj"), self.tensor(f"{ex}.down_proj_bias"))
            return MoEBaseWeights(w_gate_up=w_gate_up, w_down=w_down, router=router, num_experts=c.num_experts,
                                  norm_topk_prob=c.norm_topk_prob, b_gate_up=b_gate_up, b_down=b_down,
                                  router_bias=self.tensor(f"{p}.{block}.{fam.router_leaf}.bias"),
                                  activation=fam.activation)
        quant: dict[str, object] = {}  # fp8 experts: the block and both scale grids
        if form == "fused":
            w_gate_up = self.tensor(f"{p}.mlp.experts.gate_up_proj")
            w_down = self.tensor(f"{p}.mlp.experts.down_proj")
        else:
            g, u, d = c.family.expert_leaves
            experts = range(c.num_experts)
            gate = torch.stack([self.tensor(f"{p}.{block}.experts.{e}.{g}.weight") for e in experts])  # [E, I, H]
            up = torch.stack([self.tensor(f"{p}.{block}.experts.{e}.{u}.weight") for e in experts])  # [E, I, H]
            w_gate_up = torch.cat([gate, up], dim=1)  # [E, 2I, H], gate rows first
            w_down = torch.stack([self.tensor(f"{p}.{block}.experts.{e}.{d}.weight") for e in experts])  # [E, H, I]
            if c.weight_block is not None:  # fp8: gate's scale grid then up's, per expert (MoEBaseWeights)
                def scales(leaf: str) -> torch.Tensor:
                    return torch.stack([self.scale(f"{p}.{block}.experts.{e}.{leaf}.weight") for e in experts])
                quant = dict(weight_block=c.weight_block,
                             w_gate_up_scale_inv=torch.cat([scales(g), scales(u)], dim=1).contiguous(),
                             w_down_scale_inv=scales(d).contiguous())
        return MoEBaseWeights(
            w_gate_up=w_gate_up.contiguous(),
            w_down=w_down.contiguous(),
            router=router,
            num_experts=c.num_experts,
            norm_topk_prob=c.norm_topk_prob,
            routing=c.routing,
            router_correction_bias=self.tensor(f"{p}.mlp.gate.e_score_correction_bias") if c.routing else None,
            **quant,
        )

    def shared_expert(self, layer: int) -> SharedExpertWeights | None:
        """Layer ``layer``'s shared expert (Qwen2-MoE), or None for a family without one.

        Raises:
            IndexError: ``layer`` outside ``[0, num_layers)``.
        """
        self._check_layer(layer)
        c = self.config
        if not c.family.shared_expert or not c.is_moe_layer(layer):
            return None
        if not c.family.shared_gate:  # DeepSeek-V3: ungated shared experts
            keys = self._mlp_keys(f"model.layers.{layer}.mlp.{c.family.shared_block}",
                                  c.shared_expert_intermediate_size)
            return SharedExpertWeights(**{name: self.tensor(key) for name, (key, _) in keys.items()})
        return SharedExpertWeights(**{name: self.tensor(key) for name, (key, _) in self._shared_keys(layer).items()})

    def layer(self, layer: int) -> DecoderLayerWeights:
        """Every base tensor of decoder layer ``layer`` (see :mod:`moelora_core.checkpoint.layout`)."""
        self._check_layer(layer)
        if self.config.mla is not None:
            return self._deepseek_layer(layer)
        p = f"model.layers.{layer}.self_attn"
        has_qk_norm = self.config.family.qk_norm is not None
        return DecoderLayerWeights(
            q_proj=self.tensor(f"{p}.q_proj.weight"),
            k_proj=self.tensor(f"{p}.k_proj.weight"),
            v_proj=self.tensor(f"{p}.v_proj.weight"),
            o_proj=self.tensor(f"{p}.o_proj.weight"),
            q_norm=self.tensor(f"{p}.q_norm.weight") if has_qk_norm else None,
            k_norm=self.tensor(f"{p}.k_norm.weight") if has_qk_norm else None,
            input_layernorm=self.tensor(f"model.layers.{layer}.input_layernorm.weight"),
            post_attention_layernorm=self.tensor(f"model.layers.{layer}.post_attention_layernorm.weight"),
            moe=self.moe(layer),
            shared_expert=self.shared_expert(layer),
            **{f"{m}_bias": self.tensor(f"{p}.{m}_proj.bias") if self.config.qkv_bias else None for m in "qkv"},
            o_bias=self.tensor(f"{p}.o_proj.bias") if self.config.o_bias else None,
            sinks=self.tensor(f"{p}.sinks") if self.config.family.attention_sinks else None,
            weight_block=self.config.weight_block,
            dense_scales={m: sc for m, key in self._dense_keys(layer).items()
                          if (sc := self.scale(key)) is not None},
        )

    def _deepseek_layer(self, layer: int) -> DecoderLayerWeights:
        keys = self._mla_keys(layer)
        t = {name: self.tensor(key) for name, (key, _) in keys.items()}
        mla = MLAWeights(q_proj=t.get("q_proj"), q_a_proj=t.get("q_a_proj"), q_a_layernorm=t.get("q_a_layernorm"),
                         q_b_proj=t.get("q_b_proj"), kv_a_proj=t["kv_a_proj"], kv_a_layernorm=t["kv_a_layernorm"],
                         kv_b_proj=t["kv_b_proj"])
        dense = None
        if not self.config.is_moe_layer(layer):
            mlp = self._mlp_keys(f"model.layers.{layer}.mlp", self.config.dense_intermediate_size)
            dense = dense_mlp(*(self.tensor(key) for key, _ in mlp.values()))
        return DecoderLayerWeights(
            q_proj=mla.q_proj, k_proj=None, v_proj=None, o_proj=t["o_proj"], q_norm=None, k_norm=None,
            input_layernorm=self.tensor(f"model.layers.{layer}.input_layernorm.weight"),
            post_attention_layernorm=self.tensor(f"model.layers.{layer}.post_attention_layernorm.weight"),
            moe=self.moe(layer), shared_expert=self.shared_expert(layer), mla=mla, dense_mlp=dense,
            weight_block=self.config.weight_block,
            dense_scales={m: sc for m, key in self._dense_keys(layer).items()
                          if (sc := self.scale(key)) is not None},
        )

    def _dense_keys(self, layer: int) -> dict[str, str]:
        """moelora dense module → its weight key in ``layer`` (attention; the shared expert's; DeepSeek-V3:
        the MLA projections, the shared experts' on an MoE layer, the dense MLP's on a dense one)."""
        p = f"model.layers.{layer}"
        if self.config.mla is not None:
            mla = {"q_proj": "q", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj": "kv_a", "kv_b_proj": "kv_b",
                   "o_proj": "o"}
            keys = {mla[name]: key for name, (key, _) in self._mla_keys(layer).items() if name in mla}
            moe = self.config.is_moe_layer(layer)
            mlp = self._mlp_keys(f"{p}.mlp.shared_experts" if moe else f"{p}.mlp",
                                 self.config.shared_expert_intermediate_size if moe
                                 else self.config.dense_intermediate_size)
            names = SHARED_EXPERT_MODULES if moe else DENSE_MLP_MODULES
            keys.update({m: key for m, (key, _) in zip(names, mlp.values())})
            return keys
        keys = {m: f"{p}.self_attn.{m}_proj.weight" for m in "qkvo"}
        if self.config.family.shared_expert:
            keys.update({f"shared_{n}": f"{p}.mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")})
        return keys

    def embed_tokens(self) -> torch.Tensor:
        """[V, H] token embedding."""
        return self.tensor("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        """[H] final RMSNorm weight."""
        return self.tensor("model.norm.weight")

    def lm_head(self) -> torch.Tensor:
        """[V, H] LM head (the embedding when the checkpoint ties them and stores no head)."""
        return self.tensor("lm_head.weight") if "lm_head.weight" in self._layout else self.embed_tokens()

    def read_all(self) -> ModelWeights:
        """Every tensor of the model, in moelora's layout."""
        return ModelWeights(
            config=self.config,
            embed_tokens=self.embed_tokens(),
            layers=[self.layer(i) for i in range(self.config.num_layers)],
            norm=self.final_norm(),
            lm_head=self.lm_head(),
        )

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer {layer!r} outside [0, {self.config.num_layers})")

    def close(self) -> None:
        self._src.close()

    def __enter__(self) -> MoECheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_checkpoint(path: str | Path, *, dtype: torch.dtype | None = None) -> ModelWeights:
    """Read a whole checkpoint into moelora's layout (see :class:`MoECheckpoint` for errors)."""
    with MoECheckpoint(path, dtype=dtype) as ckpt:
        return ckpt.read_all()
