"""Stands in for ``vllm._custom_ops`` (Python bindings of vLLM's compiled ops).

``vllm._custom_ops`` loads ``vllm._C`` / ``vllm._moe_C_stable_libtorch`` at import
(``current_platform.import_kernels()``): compiled extensions built for CUDA and torch 2.14. Here:
``OSError: Could not load this library: .../vllm/_moe_C_stable_libtorch.abi3.so`` (``libtorch.so:
cannot open shared object file``); on the GPU machine (torch 2.11) the ABI differs too.

Provides: ``moe_lora_align_block_size(...)`` with vLLM's signature (``torch.ops._moe_C.
moe_lora_align_block_size``: per slot, the (token, k) pairs of that slot's tokens grouped by
expert, each group padded to ``block_size``; padding rows hold ``topk_ids.numel()``; expert ids
-1 past the last block), served by a **stand-in** — moelora's Triton ``moe_lora_align_block_size``
(the same contract, DESIGN.md §4), its rows copied into vLLM's buffers (vLLM's per-slot capacity
``numel + E·(block-1)`` always holds every used row). Used on every device (CPU substitute and GPU
stand-in alike); ``expert_map`` (expert parallelism) raises.
"""

from __future__ import annotations

import torch


def moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                              max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                              num_tokens_post_pad, adapter_enabled, lora_ids, expert_map=None) -> None:
    from moelora_kernels.align import moe_lora_align_block_size as align

    if expert_map is not None:
        raise NotImplementedError("moelora_peers: the align stand-in takes no expert_map (expert parallelism)")
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    out = align(ids, token_lora_mapping.to(torch.int32).contiguous(), num_experts, block_size, max_loras,
                adapter_enabled[:max_loras].to(torch.int32).contiguous())
    rows = min(out.sorted_token_ids.shape[1], max_num_tokens_padded)
    blocks = min(out.expert_ids.shape[1], max_num_m_blocks)
    sorted_view = sorted_token_ids.view(max_loras, -1)
    sorted_view.fill_(topk_ids.numel())
    sorted_view[:, :rows].copy_(out.sorted_token_ids[:, :rows])
    experts_view = experts_ids.view(max_loras, -1)
    experts_view.fill_(-1)
    experts_view[:, :blocks].copy_(out.expert_ids[:, :blocks])
    num_tokens_post_pad.copy_(out.num_tokens_post_padded)
