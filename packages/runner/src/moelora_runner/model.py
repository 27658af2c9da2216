"""The decoder: Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GPT-OSS and DeepSeek-V3 from ``moelora_core.checkpoint``
weights, with LoRA from one backend and one ``LoRAWeights`` pool per layer.

Per decoder layer (as transformers 5.17 computes it; x rows are the step's tokens):

    a = rms_norm(h, input_layernorm)
    q, k, v = a W_qᵀ, a W_kᵀ, a W_vᵀ        + backend.dense_delta("q"/"k"/"v", ...)    (PEFT: base + σ·B(A a))
               (+ b_q, b_k, b_v with Qwen2-MoE's qkv_bias / GPT-OSS's attention_bias, in the base GEMM,
                before the delta; GPT-OSS's o has a bias too)
    OLMoE:     q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)   over heads·head_dim, then clip_qkv
    Qwen3-MoE: q, k = rms_norm per head over head_dim
    q, k = rope(q, k, positions)               (θ of the config; rotate-half, transformers' default RoPE)
    o = attention(q, k, v) W_oᵀ                + backend.dense_delta("o", ...)
               (GPT-OSS: per-head sink logits in the softmax; the window of "sliding_attention" layers)
    h = h + o
    m = rms_norm(h, post_attention_layernorm)
    topk_weights, topk_ids = route_topk(m W_routerᵀ (+ b_router), top_k, norm_topk_prob)   (fp32 softmax → top-k)
               (DeepSeek-V3: route_grouped_sigmoid of the fp32 logits, correction bias, groups, scaling factor)
               (GPT-OSS: router bias, expert biases and swiglu_oai in the base MoE path; DESIGN.md §1)
    h = h + moe_layer_forward(base path, m, topk_ids, topk_weights, base, backend, pool, info)
    Qwen2-MoE: h += shared_expert_forward(m, shared, dense path)   (sigmoid-gated SwiGLU; its gate / up /
               down are dense projections: base GEMM + backend.dense_delta("shared_gate"/"shared_up"/"shared_down"))
    DeepSeek-V3: q/k/v from MLA (:mod:`moelora_runner.mla`, LoRA on q_a/q_b/kv_a/kv_b through dense_delta;
               YaRN RoPE, its softmax scale); the ungated shared experts add to the routed sum; the first
               ``first_k_dense_replace`` layers run a dense SwiGLU (dense_gate/up/down) instead of the MoE block

then ``logits = rms_norm(h, norm)[logits_indices] lm_headᵀ`` (the embedding when tied).

Under TP / EP (:mod:`moelora_runner.parallel`) each rank holds its slice of the weights
(:func:`~moelora_runner.parallel.sharding.shard_layer`) and the layer adds the collectives: o's
partial output (base + LoRA delta) is summed by one all-reduce before the residual add when attention
is split; under EP the routed ids are mapped to this rank's experts (others become
``EXPERT_NOT_HERE``, which the MoE path gives nothing); the MoE block's partial output (base + deltas,
router-weighted, top-k summed) is summed by one all-reduce before the residual add. OLMoE's q/k norm
over all heads sums its squares over the ranks (:func:`rms_norm_split`). The router and the
embedding / LM head stay whole on every rank. At one rank none of this runs.

The forward is split where a graph runner needs seams: :meth:`MoEDecoder.embed`,
:meth:`MoEDecoder.pre_attention`, :meth:`MoEDecoder.attention` (the KV write and read, the one step
that reads per-request metadata), :meth:`MoEDecoder.post_attention`, :meth:`MoEDecoder.logits`; a
``breakable`` prefill graph captures everything between two attention calls. No step branches on a
device value or reads one; every shape comes from host numbers. :meth:`MoEDecoder.hidden_states` is
the forward up to the final norm (what ``full`` and decode graphs capture; the LM head runs on the
step's logits rows after the replay).

fp8 block-scaled checkpoints (DESIGN.md §1): the experts and the dense projections stored fp8 stay fp8
with their fp32 block scales; their base products are w8a8 (the MoE base path's fp8 GEMMs; dense:
``moelora_reference.fp8_block.fp8_linear``), and every LoRA delta reads the unquantized activations.

Dtypes: weights and activations in the model dtype; RMSNorm and the router softmax in fp32 (as
transformers); the MoE base path and the backend decide their own intermediates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelora_core.base_weights import MoEBaseWeights
from moelora_core.checkpoint import DecoderLayerWeights, ModelWeights, MoEModelConfig
from moelora_core.fp8_block import FP8_DTYPE
from moelora_core.moe_deltas import BaseMoEPath, moe_layer_forward
from moelora_core.sentinels import EXPERT_NOT_HERE
from moelora_core.shared_expert import shared_expert_forward
from moelora_core.weights import LoRAWeights
from moelora_reference.base_moe import route_topk
from moelora_reference.fp8_block import fp8_linear
from moelora_reference.routing import route_grouped_sigmoid
from moelora_runner.attention import paged_attention, write_kv
from moelora_runner.forward_batch import ForwardBatch
from moelora_runner.kv_cache import KVCache
from moelora_runner.mla import MLA_NORM_EPS, MLARotary, softmax_scale
from moelora_runner.parallel.comm import Collectives
from moelora_runner.parallel.layout import ParallelLayout
from moelora_runner.parallel.sharding import shard_layer

F32 = torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, round to x's dtype, then scale by ``weight``."""
    x32 = x.to(F32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_split(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], eps: float,
                   widths: Sequence[int], comm: Collectives) -> list[torch.Tensor]:
    """:func:`rms_norm` of tensors whose last dim is split over the ranks (OLMoE's q/k norm under TP):
    each rank's squared sums (fp32) are summed by one all-reduce for all of ``xs`` together, then
    divided by the full ``widths``; each rank scales its own slice by its slice of the weight.

    Args:
        xs: [T, n_i] this rank's slices. weights: [n_i] their norm weights. widths: the full widths.
    """
    x32 = [x.to(F32) for x in xs]
    sums = torch.stack([x.pow(2).sum(-1) for x in x32], dim=-1)  # [T, len(xs)]
    comm.all_reduce_(sums)
    return [w * (x * torch.rsqrt(sums[:, i:i + 1] / n + eps)).to(x0.dtype)
            for i, (x, x0, w, n) in enumerate(zip(x32, xs, weights, widths))]


def local_expert_ids(topk_ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """EP: global expert ids [T, k] → this rank's ids (``id - first``), ``EXPERT_NOT_HERE`` for the
    experts of other ranks (device-side, no host read)."""
    local = topk_ids - first
    here = (local >= 0) & (local < count)
    return torch.where(here, local, torch.full_like(local, EXPERT_NOT_HERE))


class RotaryEmbedding:
    """transformers' default RoPE: inv_freq = 1/θ^(2i/d), cos/sin of position·inv_freq in fp32 (table
    over every position up to ``max_positions``), rounded to the model dtype, rotate-half form."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(F32) / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.int64).to(F32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, d]
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, nh, d], k [T, nkv, d] rotated by ``positions`` [T]."""
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.sin.index_select(0, positions)[:, None, :]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


@dataclass
class LoRAContext:
    """Who adds LoRA in a forward: the backend (one for every layer) and each layer's pool."""

    backend: object
    pools: Sequence[LoRAWeights]


class DecoderLayer:
    """One decoder layer's weights and its pre-/post-attention steps (see the module doc).

    Args:
        index: the layer's index. weights: this rank's weights (whole at one rank).
        config: the model's (global) config. router: [E, H] the whole router.
        parallel: the rank's layout (None = one rank). comm: its collectives (needed when parallel).
    """

    def __init__(self, index: int, weights: DecoderLayerWeights, config: MoEModelConfig,
                 router: torch.Tensor | None = None, parallel: ParallelLayout | None = None,
                 comm: Collectives | None = None) -> None:
        self.index = index
        self.w = weights
        self.config = config
        self.moe: MoEBaseWeights | None = weights.moe  # None: DeepSeek-V3's dense first layers
        self.router = (None if weights.moe is None else weights.moe.router) if router is None else router
        self.router_bias = None if weights.moe is None else weights.moe.router_bias  # GPT-OSS
        self.parallel = parallel or ParallelLayout.single()
        self.comm = comm
        self.heads, self.kv_heads = self.parallel.heads(config)
        self.experts = self.parallel.experts(config)

    def _dense(self, module: str, x: torch.Tensor, lora: LoRAContext, fb: ForwardBatch) -> torch.Tensor:
        scale = self.w.dense_scales.get(module)
        if scale is not None:  # an fp8 projection: w8a8 base, the delta below on the unquantized x (DESIGN.md §1)
            out = fp8_linear(x, self.w.dense(module), scale, self.w.weight_block, self.w.bias(module))
        else:
            out = F.linear(x, self.w.dense(module), self.w.bias(module))  # q/k/v bias: Qwen2-MoE qkv_bias
        lora.backend.dense_delta(module, x, out, lora.pools[self.index], fb.lora_info)
        return out

    def pre_attention(self, h: torch.Tensor, fb: ForwardBatch, lora: LoRAContext,
                      rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, nh, d], k [T, nkv, d], v [T, nkv, d]) of hidden states h [T, H]."""
        c = self.config
        eps = c.rms_norm_eps
        a = rms_norm(h, self.w.input_layernorm, eps)
        if self.w.mla is not None:
            return self._mla_qkv(a, fb, lora, rope)
        q, k, v = (self._dense(m, a, lora, fb) for m in ("q", "k", "v"))
        T = h.shape[0]
        if c.family.qk_norm == "full" and self.parallel.tp > 1:
            q, k = rms_norm_split((q, k), (self.w.q_norm, self.w.k_norm), eps,
                                  (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim), self.comm)
        elif c.family.qk_norm == "full":
            q, k = rms_norm(q, self.w.q_norm, eps), rms_norm(k, self.w.k_norm, eps)
        q = q.view(T, self.heads, c.head_dim)
        k = k.view(T, self.kv_heads, c.head_dim)
        v = v.view(T, self.kv_heads, c.head_dim)
        if c.family.qk_norm == "per_head":
            q, k = rms_norm(q, self.w.q_norm, eps), rms_norm(k, self.w.k_norm, eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k = rope.apply(q, k, fb.positions)
        return q, k, v

    def _mla_qkv(self, a: torch.Tensor, fb: ForwardBatch, lora: LoRAContext,
                 rope: MLARotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's MLA (:mod:`moelora_runner.mla`): q, k [T, nh, qk_head_dim] and v [T, nh,
        qk_head_dim] (zero-padded past v_head_dim) of the normed rows a [T, H]."""
        m, w = self.config.mla, self.w.mla
        T = a.shape[0]
        if w.q_proj is not None:
            q = self._dense("q", a, lora, fb)
        else:
            q = self._dense("q_b", rms_norm(self._dense("q_a", a, lora, fb), w.q_a_layernorm, MLA_NORM_EPS), lora, fb)
        q_nope, q_rot = q.view(T, self.heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rot = self._dense("kv_a", a, lora, fb).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self._dense("kv_b", rms_norm(c, w.kv_a_layernorm, MLA_NORM_EPS), lora, fb)
        k_nope, v = kv.view(T, self.heads, m.qk_nope_head_dim + m.v_head_dim).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q_rot, k_rot = rope.apply(q_rot, k_rot.reshape(T, 1, m.qk_rope_head_dim), fb.positions)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(T, self.heads, m.qk_rope_head_dim)], dim=-1)
        return q, k, F.pad(v, (0, m.qk_head_dim - m.v_head_dim))

    def route(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32) of the normed hidden states m [T, H] by the
        whole router (DESIGN.md §1; DeepSeek-V3's in fp32 as ``DeepseekV3TopkRouter``)."""
        c = self.config
        if self.moe.routing is None:
            return route_topk(F.linear(m, self.router, self.router_bias), c.top_k, c.norm_topk_prob)
        return route_grouped_sigmoid(F.linear(m.to(F32), self.router.to(F32)), self.moe.router_correction_bias,
                                     c.top_k, self.moe.routing, c.norm_topk_prob)

    def post_attention(self, attn: torch.Tensor, h: torch.Tensor, fb: ForwardBatch, lora: LoRAContext,
                       moe_path: BaseMoEPath) -> torch.Tensor:
        """The layer's output hidden states [T, H] from the attention output [T, nh·d] and its input h."""
        c, par = self.config, self.parallel
        if c.mla is not None:  # MLA: the cache's padded V columns are cut before o
            attn = attn.view(attn.shape[0], self.heads, c.head_dim)[..., :c.mla.v_head_dim].reshape(attn.shape[0], -1)
        o = self._dense("o", attn, lora, fb)
        if par.tp > 1:
            self.comm.all_reduce_(o)  # row-parallel o: base and LoRA partials summed together
        h = h + o
        m = rms_norm(h, self.w.post_attention_layernorm, c.rms_norm_eps)
        if self.moe is None:  # DeepSeek-V3's dense first layers: an ungated SwiGLU, LoRA on dense_*
            return h + shared_expert_forward(m, self.w.dense_mlp, lambda mod, x: self._dense(mod, x, lora, fb))
        topk_weights, topk_ids = self.route(m)
        if par.ep > 1:
            topk_ids = local_expert_ids(topk_ids, *self.experts)
        y = moe_layer_forward(moe_path, m, topk_ids, topk_weights, self.moe, lora.backend,
                              lora.pools[self.index], fb.lora_info)
        if par.parallel:
            self.comm.all_reduce_(y)  # the MoE combine: every rank's partial (base + deltas) summed
        if self.w.shared_expert is not None:
            # transformers adds the gated shared expert to the routed output before the residual
            # (never on a split model: ParallelLayout.check refuses one with a shared expert).
            y = y + shared_expert_forward(m, self.w.shared_expert, lambda mod, x: self._dense(mod, x, lora, fb))
        return h + y


def _moved_dense_layer(lw: DecoderLayerWeights, to, keep) -> DecoderLayerWeights:
    """A DeepSeek-V3 dense layer (MLA + dense MLP, no MoE block) moved by ``to`` (its fp8 block scales,
    if any, by ``keep``: moved, never cast)."""
    return DecoderLayerWeights(q_proj=to(lw.q_proj), k_proj=None, v_proj=None, o_proj=to(lw.o_proj), q_norm=None,
                               k_norm=None, input_layernorm=to(lw.input_layernorm),
                               post_attention_layernorm=to(lw.post_attention_layernorm), moe=None,
                               mla=lw.mla.map(to), dense_mlp=lw.dense_mlp.map(to), weight_block=lw.weight_block,
                               dense_scales={m: keep(t) for m, t in lw.dense_scales.items()})


class MoEDecoder:
    """The whole model on one device (see the module doc).

    Args:
        weights: from ``moelora_core.checkpoint.read_checkpoint`` (moved to ``device`` / ``dtype`` here).
        dtype, device: compute dtype and device.
        max_positions: RoPE table length (the engine's context).
        sliding_window: attention window of every layer (None = full causal attention); a config
            with ``layer_types`` (GPT-OSS) sets its own per layer.
        moe_path: the base MoE path (:mod:`moelora_runner.moe_paths`).
        parallel: this rank's layout (None = one rank: the weights are used whole); the weights
            are the whole model's and each layer keeps its slice.
        comm: the rank's collectives (required when ``parallel`` spans more than one rank).
    """

    def __init__(self, weights: ModelWeights, *, dtype: torch.dtype, device: torch.device, max_positions: int,
                 sliding_window: int | None, moe_path: BaseMoEPath, parallel: ParallelLayout | None = None,
                 comm: Collectives | None = None) -> None:
        self.parallel = parallel or ParallelLayout.single()
        if self.parallel.parallel and comm is None:
            raise ValueError(f"a model split {self.parallel.describe()} needs its collectives (comm=)")
        self.config = weights.config
        self.dtype = dtype
        self.device = device
        self.sliding_window = sliding_window
        self.moe_path = moe_path

        def to(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is not None and t.dtype == FP8_DTYPE:  # fp8 weights stay fp8 (their scales fp32: keep)
                return t.to(device=device).contiguous()
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        def keep(t: torch.Tensor | None) -> torch.Tensor | None:  # fp32 block scales: moved, never cast
            return None if t is None else t.to(device=device).contiguous()

        self.embed_tokens = to(weights.embed_tokens)
        self.norm = to(weights.norm)
        # Tied as transformers ties: by the config, whatever the file stores.
        self.lm_head = self.embed_tokens if weights.config.tie_word_embeddings else to(weights.lm_head)
        self.layers = []
        for i, lw in enumerate(weights.layers):
            if lw.moe is None:  # DeepSeek-V3's dense first layers (never split: shared experts refuse TP/EP)
                self.layers.append(DecoderLayer(i, _moved_dense_layer(lw, to, keep), self.config, None, self.parallel,
                                                comm))
                continue
            router = to(lw.moe.router)
            if self.parallel.parallel:
                lw = shard_layer(lw, self.config, self.parallel)
            moe = MoEBaseWeights(w_gate_up=to(lw.moe.w_gate_up), w_down=to(lw.moe.w_down),
                                 router=None if self.parallel.parallel else router,
                                 num_experts=lw.moe.num_experts, norm_topk_prob=lw.moe.norm_topk_prob,
                                 b_gate_up=to(lw.moe.b_gate_up), b_down=to(lw.moe.b_down),
                                 router_bias=to(lw.moe.router_bias), activation=lw.moe.activation,
                                 routing=lw.moe.routing, router_correction_bias=None
                                 if lw.moe.router_correction_bias is None
                                 else lw.moe.router_correction_bias.to(device=device, dtype=F32),
                                 weight_block=lw.moe.weight_block, w_gate_up_scale_inv=keep(lw.moe.w_gate_up_scale_inv),
                                 w_down_scale_inv=keep(lw.moe.w_down_scale_inv))
            moved = DecoderLayerWeights(q_proj=to(lw.q_proj), k_proj=to(lw.k_proj), v_proj=to(lw.v_proj),
                                        o_proj=to(lw.o_proj), q_norm=to(lw.q_norm), k_norm=to(lw.k_norm),
                                        input_layernorm=to(lw.input_layernorm),
                                        post_attention_layernorm=to(lw.post_attention_layernorm), moe=moe,
                                        shared_expert=None if lw.shared_expert is None else lw.shared_expert.map(to),
                                        q_bias=to(lw.q_bias), k_bias=to(lw.k_bias), v_bias=to(lw.v_bias),
                                        o_bias=to(lw.o_bias), sinks=to(lw.sinks),
                                        mla=None if lw.mla is None else lw.mla.map(to),
                                        weight_block=lw.weight_block,
                                        dense_scales={m: keep(t) for m, t in lw.dense_scales.items()})
            self.layers.append(DecoderLayer(i, moved, self.config, router, self.parallel, comm))
        c = self.config
        # GPT-OSS: the window applies to its "sliding_attention" layers only (config.layer_types)
        self.windows: list[int | None] = (
            [c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
            if c.layer_types is not None else [sliding_window] * len(self.layers))
        self.rope = (MLARotary(c, max_positions, dtype, device) if c.mla is not None
                     else RotaryEmbedding(c.head_dim, c.rope_theta, max_positions, dtype, device))
        self.attention_scale = softmax_scale(c) if c.mla is not None else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_width(self) -> int:
        """Features of this rank's attention output (its heads · head_dim): o's input."""
        return self.layers[0].heads * self.config.head_dim

    def bytes(self) -> int:
        """Bytes of the model's weights on the device."""
        seen: dict[int, int] = {}
        tensors = [self.embed_tokens, self.norm, self.lm_head]
        for layer in self.layers:
            w = layer.w
            tensors += [w.q_proj, w.k_proj, w.v_proj, w.o_proj, w.q_norm, w.k_norm, w.input_layernorm,
                        w.post_attention_layernorm, layer.router, w.q_bias, w.k_bias, w.v_bias, w.o_bias, w.sinks,
                        *w.dense_scales.values()]
            if w.moe is not None:
                tensors += [w.moe.w_gate_up, w.moe.w_down, w.moe.b_gate_up, w.moe.b_down, w.moe.router_bias,
                            w.moe.w_gate_up_scale_inv, w.moe.w_down_scale_inv]
            for se in (w.shared_expert, w.dense_mlp):
                if se is not None:
                    tensors += [se.gate_proj, se.up_proj, se.down_proj, se.gate]
            if w.mla is not None:
                m = w.mla
                tensors += [m.q_proj, m.q_a_proj, m.q_a_layernorm, m.q_b_proj, m.kv_a_proj, m.kv_a_layernorm,
                            m.kv_b_proj]
        for t in tensors:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    # --- the forward's steps -------------------------------------------------------------------

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        """[T, H] token embeddings."""
        return F.embedding(fb.input_ids, self.embed_tokens)

    def pre_attention(self, i: int, h: torch.Tensor, fb: ForwardBatch, lora: LoRAContext):
        return self.layers[i].pre_attention(h, fb, lora, self.rope)

    def attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                  kv: KVCache) -> torch.Tensor:
        """Write the step's K/V into layer ``i``'s cache, then attend: [T, nh·d]."""
        write_kv(kv.k[i], kv.v[i], k, v, fb)
        return paged_attention(q, kv.k[i], kv.v[i], kv.req_to_token, fb, sliding_window=self.windows[i],
                               sinks=self.layers[i].w.sinks, scale=self.attention_scale)

    def post_attention(self, i: int, attn: torch.Tensor, h: torch.Tensor, fb: ForwardBatch,
                       lora: LoRAContext) -> torch.Tensor:
        return self.layers[i].post_attention(attn, h, fb, lora, self.moe_path)

    def logits(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """[n, V] logits (model dtype) of the rows ``fb.logits_indices``."""
        rows = h.index_select(0, fb.logits_indices)
        return F.linear(rms_norm(rows, self.norm, self.config.rms_norm_eps), self.lm_head)

    def hidden_states(self, fb: ForwardBatch, kv: KVCache, lora: LoRAContext) -> torch.Tensor:
        """[T, H] the last layer's output (before the final norm): embed → every layer
        (pre-attention, attention, post-attention). What a ``full`` or decode graph captures."""
        h = self.embed(fb)
        for i in range(self.num_layers):
            q, k, v = self.pre_attention(i, h, fb, lora)
            attn = self.attention(i, q, k, v, fb, kv)
            h = self.post_attention(i, attn, h, fb, lora)
        return h

    def forward(self, fb: ForwardBatch, kv: KVCache, lora: LoRAContext) -> torch.Tensor:
        """The eager forward: :meth:`hidden_states` → :meth:`logits`."""
        return self.logits(self.hidden_states(fb, kv, lora), fb)
