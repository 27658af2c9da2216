"""DeepSeek-V3's multi-head latent attention in the engine: the readable, graph-safe reference form
(DESIGN.md §1; transformers 5.17 ``DeepseekV3Attention``), which caches the full per-head K and V.

For the step's rows a [T, H] (after the input norm), every projection a dense module with its LoRA
(``Backend.dense_delta``, added to the base GEMM before the norm a projection feeds):

    q            = q_b(RMSNorm(q_a(a)))  (or q(a) without q_lora_rank)     [T, nh, nope + rope]
    [c, k_rope]  = kv_a(a);  c = RMSNorm(c)                                [T, kv_lora_rank], [T, rope]
    [k_nope, v]  = kv_b(c)                                                 [T, nh, nope], [T, nh, v_dim]
    q_rope, k_rope = RoPE(q_rope, k_rope, positions)    (YaRN inv_freq and cos/sin factor; interleaved
                                                         pairs de-interleaved when ``rope_interleave``)
    K = [k_nope, k_rope (one head, every head)],  Q = [q_nope, q_rope]
    scores scaled by qk_head_dim^-1/2 · m² (m = 0.1 · mscale_all_dim · ln(factor) + 1 under YaRN)

The cache keeps K [.., nh, qk_head_dim] and V zero-padded to qk_head_dim (one cache geometry for
every family); the attention output is cut back to v_head_dim per head before ``o``. The latent
cache and weight absorption are a later step. The q_a / kv_a norms use ε = 1e-6 (transformers builds
them with its default, not ``rms_norm_eps``).
"""

from __future__ import annotations

import math

import torch

from moelora_core.checkpoint import MoEModelConfig

F32 = torch.float32
#: ε of MLA's q_a_layernorm / kv_a_layernorm (``DeepseekV3RMSNorm``'s default).
MLA_NORM_EPS = 1e-6


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, rope: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32, attention_factor) of YaRN as transformers 5.17
    ``_compute_yarn_parameters`` computes them (arXiv:2309.00071): per frequency a linear ramp between
    the extrapolated 1/θ^(2i/d) and the interpolated 1/(factor · θ^(2i/d)) over the correction range
    of ``beta_fast`` / ``beta_slow`` rotations in ``original_max_position_embeddings``."""
    base = float(rope.get("rope_theta", 10000.0))
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / orig
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                            else _mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=F32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(F32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(config: MoEModelConfig) -> float:
    """qk_head_dim^-1/2, times m² under YaRN with ``mscale_all_dim`` (``yarn_apply_mscale``)."""
    m = config.mla
    scale = m.qk_head_dim ** -0.5
    rope = m.rope
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        ms = _mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * ms * ms
    return scale


class MLARotary:
    """RoPE of MLA's rope dims: cos/sin tables over every position (fp32, times YaRN's attention
    factor, rounded to the model dtype), rotate-half or interleaved pairs (``rope_interleave``:
    transformers ``apply_rotary_pos_emb_interleave``, whose output is de-interleaved, evens then odds)."""

    def __init__(self, config: MoEModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        m = config.mla
        dim = m.qk_rope_head_dim
        rope = m.rope
        if rope.get("rope_type", "default") == "yarn":
            inv_freq, factor = yarn_inv_freq(dim, rope, max_positions)
        else:
            theta = float(rope.get("rope_theta", config.rope_theta))
            inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(F32) / dim)), 1.0
        freqs = torch.arange(max_positions, dtype=torch.int64).to(F32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, dim]
        self.cos = (emb.cos() * factor).to(dtype).to(device)
        self.sin = (emb.sin() * factor).to(dtype).to(device)
        self.interleave = m.rope_interleave

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, nh, r], k [T, 1, r] rotated by ``positions`` [T]."""
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.sin.index_select(0, positions)[:, None, :]
        if self.interleave:
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]

            def rot(x: torch.Tensor) -> torch.Tensor:
                x1, x2 = x[..., 0::2], x[..., 1::2]
                return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

            return rot(q), rot(k)

        def rotate_half(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
