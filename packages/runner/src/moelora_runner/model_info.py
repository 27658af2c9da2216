"""What the engine needs from a checkpoint beyond ``moelora_core.checkpoint.MoEModelConfig``: the context
length, the eos tokens, the attention window and the RoPE type, from ``config.json`` (and
``generation_config.json`` for eos, as ``transformers``' ``generate`` reads it).

Refused here, before any weight is read: a RoPE type other than "default" (DeepSeek-V3: "default"
or "yarn", which its MLA applies; other scaled RoPE variants
change the position encoding; the engine would serve wrong logits); a Qwen2-MoE with
``use_sliding_window`` (its window applies to some layers only, by ``layer_types``).

The attention window follows transformers 5.17: Mixtral masks by ``sliding_window`` when set;
Qwen3-MoE and Qwen2-MoE only with ``use_sliding_window``; OLMoE never (its mask is always plain causal);
GPT-OSS per layer (``MoEModelConfig.layer_types`` / ``sliding_window``, applied by the model itself, so
``ModelInfo.sliding_window`` is None for it). GPT-OSS checkpoints as released use YaRN RoPE and are
refused by the RoPE rule above; the fixtures use the default RoPE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moelora_core.checkpoint import MoEModelConfig, UnsupportedModelError, read_model_config


def _int_list(value: object) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


@dataclass(frozen=True)
class ModelInfo:
    """A checkpoint's config as the engine uses it.

    Attributes:
        config: the readers' typed config (dims, family, RoPE θ, norms, tying).
        max_context: ``max_position_embeddings``: the longest sequence (prompt + output) served.
        eos_token_ids: tokens that end a request unless ``ignore_eos`` (config.json and
            generation_config.json together).
        sliding_window: keys older than this many positions are masked (None = full attention).
        bos_token_id: from config.json, or None.
    """

    config: MoEModelConfig
    max_context: int
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    bos_token_id: int | None

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelInfo:
        """Read ``model_dir/config.json`` (and ``generation_config.json`` when present).

        Raises:
            CheckpointFormatError, UnsupportedModelError: from ``read_model_config``; a RoPE type
                other than "default"; a Qwen2-MoE with ``use_sliding_window``.
        """
        model_dir = Path(model_dir)
        config = read_model_config(model_dir)
        if config.mla is not None and config.mla.v_head_dim > config.mla.qk_head_dim:
            # the engine's one cache geometry holds V zero-padded to the key width (moelora_runner.mla)
            raise UnsupportedModelError(model_dir, "config.json v_head_dim", "MLA with a value head wider than "
                                        "the query/key head is not served", expected=f"<= {config.mla.qk_head_dim}",
                                        found=config.mla.v_head_dim)
        raw = json.loads((model_dir / "config.json").read_text())
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type != "default" and not (config.mla is not None and rope_type == "yarn"):
            raise UnsupportedModelError(model_dir, "config.json rope_parameters.rope_type",
                                        "only the default RoPE is served", expected="'default'", found=repr(rope_type))
        if config.model_type == "qwen2_moe" and raw.get("use_sliding_window"):
            # Qwen2MoeConfig slides the window on some layers only (layer_types); the engine has one
            # window for every layer.
            raise UnsupportedModelError(model_dir, "config.json use_sliding_window", "Qwen2-MoE's per-layer "
                                        "sliding window is not served", expected=False, found=True)
        window = raw.get("sliding_window")
        if config.model_type in ("olmoe", "gpt_oss") or (config.model_type in ("qwen3_moe", "qwen2_moe")
                                            and not raw.get("use_sliding_window")):
            window = None
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            window = None
        max_ctx = raw.get("max_position_embeddings", 4096)
        if not isinstance(max_ctx, int) or isinstance(max_ctx, bool) or max_ctx < 1:
            max_ctx = 4096
        eos = list(_int_list(raw.get("eos_token_id")))
        gen_file = model_dir / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                gen = {}
            eos += [t for t in _int_list(gen.get("eos_token_id")) if t not in eos]
        bos = raw.get("bos_token_id")
        return cls(config=config, max_context=max_ctx, eos_token_ids=tuple(eos), sliding_window=window,
                   bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None)
