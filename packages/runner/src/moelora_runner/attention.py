"""Attention over the KV cache, one decoder layer at a time (a separately callable step: the
``breakable`` prefill graph runs it eagerly between captured segments).

For every row t of the step (request r, position p), with K/V locations read from the
``req_to_token`` row of r over a host-known width C (``ForwardBatch.max_context``):

    write:   k_cache[out_cache_loc[t]] = k[t];  v_cache[out_cache_loc[t]] = v[t]
    keys:    loc[t, c] = req_to_token[token_rows[t], c]           c in [0, C)
    scores:  s[t, h, c] = (q[t, h] · k_cache[loc[t, c], h // g]) · d^-0.5
             masked to -inf unless c <= p (and c > p - window with a sliding window)
    out:     o[t, h] = Σ_c softmax_c(s[t, h])(fp32, rounded to the model dtype) · v_cache[loc[t, c], h // g]

(g = heads per KV head, grouped-query attention as transformers' ``repeat_kv``: query head h reads KV
head h // g). This is transformers' eager attention (``eager_attention_forward``: matmul, scale,
additive mask, fp32 softmax rounded to the query dtype, matmul) per row; entries past a request's
length point at the null location and are masked by position, never read as data.

Graph safety: the rows are processed in chunks whose size comes from host numbers (T, C and the
geometry), the mask is computed on the device from ``positions``; no host read, no data-dependent
shape.
"""

from __future__ import annotations

import torch

from moelora_runner.forward_batch import ForwardBatch

#: Gathered K/V elements per chunk of rows (bounds the per-row gather's memory).
GATHER_BUDGET = {"cpu": 1 << 22, "cuda": 1 << 27}


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             fb: ForwardBatch) -> None:
    """Store the step's K/V ([T, nkv, d]) at ``fb.out_cache_loc`` in one layer's cache ([N + 1, nkv, d])."""
    k_cache.index_copy_(0, fb.out_cache_loc, k)
    v_cache.index_copy_(0, fb.out_cache_loc, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                    fb: ForwardBatch, *, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over the cache (see the module doc).

    Args:
        q: [T, nh, d] queries after RoPE (model dtype).
        k_cache, v_cache: [N + 1, nkv, d] one layer's cache, the step's K/V already written.
        req_to_token: [R, W] int32 request table (W >= ``fb.max_context``).
        fb: the step.
        sliding_window: keys at positions <= p - window are masked (None: full causal attention).
        sinks: [nh] GPT-OSS's per-head sink logits (model dtype), or None: one extra logit per head
            joins the softmax and its probability is dropped (it has no value), as transformers'
            ``GptOssAttention`` (``eager_attention_forward``: concatenate, softmax, drop the last column).
        scale: the scores' factor (None: d^-0.5; DeepSeek-V3's MLA: its YaRN-scaled one).

    Returns:
        [T, nh · d] in q's dtype.
    """
    T, nh, d = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    C = fb.max_context
    out = torch.empty(T, nh, d, dtype=q.dtype, device=q.device)
    key_pos = torch.arange(C, dtype=torch.int64, device=q.device)
    budget = GATHER_BUDGET.get(q.device.type, GATHER_BUDGET["cuda"])
    chunk = max(1, budget // max(1, C * nkv * d))
    scale = d ** -0.5 if scale is None else scale
    for start in range(0, T, chunk):  # T and C are host numbers: a fixed loop, graph-capturable
        stop = min(T, start + chunk)
        n = stop - start
        locs = req_to_token.index_select(0, fb.token_rows[start:stop])[:, :C].reshape(-1)  # [n·C]
        keys = k_cache.index_select(0, locs).view(n, C, nkv, d)
        values = v_cache.index_select(0, locs).view(n, C, nkv, d)
        qc = q[start:stop].view(n, nkv, g, d)
        scores = torch.einsum("tkgd,tckd->tkgc", qc, keys) * scale  # [n, nkv, g, C]
        pos = fb.positions[start:stop, None]
        allowed = key_pos[None, :] <= pos
        if sliding_window is not None:
            allowed = allowed & (key_pos[None, :] > pos - sliding_window)
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        if sinks is not None:
            sink = sinks.to(scores.dtype).view(1, nkv, g, 1).expand(n, nkv, g, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
            probs = probs.to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:stop] = torch.einsum("tkgc,tckd->tkgd", probs, values).reshape(n, nh, d)
    return out.reshape(T, nh * d)
