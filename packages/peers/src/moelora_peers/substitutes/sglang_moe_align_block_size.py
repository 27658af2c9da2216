"""CPU substitute for ``sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size``.

SGLang's ``moe_align_block_size`` calls the CUDA op ``sgl_moe_align_block_size`` (imported only on
CUDA / HIP / XPU / MUSA: on a CPU the call fails with a NameError). Its own pure-torch fallback is
``_align_block_size_torch`` in ``sglang/kernels/ops/lora/moe/virtual_experts.py`` ("for platforms
where the CUDA JIT kernel is unavailable"): same outputs (``sorted_token_ids`` padded with
``topk_ids.numel()``, ``expert_ids`` with -1 past the last block and for the sentinel bucket,
``num_tokens_post_padded``), invalid ids in a sentinel bucket. Provides ``moe_align_block_size``
calling that function's eager body (the ``torch.compile`` wrapper is not applied: inductor's C++
build is not part of the CPU run).
"""

from __future__ import annotations

import importlib


def moe_align_block_size(topk_ids, block_size, num_experts, ignore_invalid_expert=False, **_kwargs):
    fallback = importlib.import_module("sglang.kernels.ops.lora.moe.virtual_experts")._align_block_size_torch
    eager = getattr(fallback, "_torchdynamo_orig_callable", fallback)
    return eager(topk_ids, block_size, num_experts)
