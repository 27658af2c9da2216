"""SGLang 0.5.23's base fused MoE (``fused_moe_triton``) with the tuned config it ships for the card,
for the side-by-side benchmark (``benchmarks/bench_peers.py``).

SGLang's own entry point (``srt/layers/moe/moe_runner/triton_utils/fused_moe.py``, ``fused_experts``)
imports ``sgl_kernel`` on CUDA (``moe_sum_reduce``; a separate wheel, not installed) and the server's
NCCL allocators and DP-attention state, so it is not run; its kernel sequence
(``_fused_moe_kernel_sequence``, unquantized bf16 / fp16, no TMA, ``filter_expert=True``) is, from
SGLang's files:

1. ``try_get_optimal_moe_config(w1.shape, w2.shape, top_k, None, M, return_down_config=True)``
   (``fused_moe_triton_config.py``, as ``_prepare_fused_moe_run`` calls it): the tuned table
   ``configs/triton_<version>/E=<E>,N=<I>,device_name=<card>.json`` (else the newest other Triton
   version's, else ``get_default_config``), the entry nearest to M, and the ``_down`` table's for the
   down GEMM where one ships; without TMA (a table's ``USE_TMA`` is recorded, not followed);
2. the alignment ``moe_align_block_size(topk_ids, BLOCK_SIZE_M, E)`` (``sgl_kernel``'s on CUDA; where
   it is not installed, SGLang's own torch fallback ``_align_block_size_torch``:
   ``moelora_peers.sglang_modules.CPU_SUBSTITUTES``);
3. ``invoke_fused_moe_kernel`` (gate_up: x [M, H] @ w1[e]ᵀ → [M·k, 2I]), ``act_and_mul_triton``
   (SiLU(gate)·up → [M·k, I]; on CUDA SGLang's default is the JIT ``silu_and_mul``, the same math),
   ``invoke_fused_moe_kernel`` (down with the router weight, ``top_k=1`` → [M, k, H]),
   ``moe_sum_reduce_triton`` (the top-k sum; ``sgl_kernel.moe_sum_reduce`` on CUDA, the same math).

:func:`config` says which file the lookup loaded (SGLang's own log line), or "default config". The
lookup reads the server's published config once (``runtime_context.get_exec()``: deterministic
inference); it is answered with the server default (off) for the call, an attribute-level stand-in
like the CPU substitutes (conformance/docs/peers.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from moelora_peers import sglang_modules

_KERNELS = "sglang.kernels.ops.moe.fused_moe_triton_kernels"
_CONFIG = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"


@dataclass(frozen=True)
class SGLangMoEConfig:
    """The block config SGLang picks for one call and where it came from.

    Attributes:
        config: the gate_up GEMM's ``BLOCK_SIZE_M`` / ``_N`` / ``_K``, ``GROUP_SIZE_M``, ``num_warps``,
            ``num_stages`` (``BLOCK_SIZE_M`` is the alignment's too).
        down_config: the down GEMM's (SGLang's ``_down`` table where it ships one, ``BLOCK_SIZE_M``
            forced to ``config``'s as SGLang forces it; else ``config``).
        source: the tuned files SGLang loaded (paths relative to SGLang's package, ``; ``-joined), or
            "default config".
        tma_requested: a table asked for TMA (``USE_TMA``); this sequence runs without it (a
            difference from SGLang's ``fused_experts`` on Hopper, named in the benchmark's row).
    """

    config: dict
    down_config: dict
    source: str
    tma_requested: bool


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _exec_defaults() -> SimpleNamespace:
    # The lookup's one read of the server's published config (``runtime_context.get_exec()``, which a
    # server publishes from its arguments at launch): deterministic inference off, the default.
    return SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))


def config(w_gu: torch.Tensor, w_d: torch.Tensor, top_k: int, M: int) -> SGLangMoEConfig:
    """SGLang's config for ``M`` tokens over base weights ``w_gu`` [E, 2I, H] / ``w_d`` [E, H, I]
    (``try_get_optimal_moe_config``), with the file its lookup loaded (its own log message)."""
    mod = sglang_modules.import_peer(sglang_modules.importer(), _CONFIG)
    log = logging.getLogger(mod.__name__)
    handler, level = _Messages(), log.level
    mod.get_moe_configs.cache_clear()  # its lru_cache would hide the lookup's message on a second call
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    get_exec = mod.get_exec
    mod.get_exec = _exec_defaults
    try:
        cfg, (down, _) = mod.try_get_optimal_moe_config(tuple(w_gu.shape), tuple(w_d.shape), top_k, None, M,
                                                         return_down_config=True)
    finally:
        mod.get_exec = get_exec
        log.removeHandler(handler)
        log.setLevel(level)
    files = []
    for line in handler.lines:
        # "Using MoE kernel config from <path>." or "... Fallback to triton version X and use MoE kernel
        # config from <path>."
        if "MoE kernel config from " in line:
            path = line.rsplit("MoE kernel config from ", 1)[1].rstrip(". ")
            files.append(path.split("/sglang/", 1)[-1])
    cfg, down = dict(cfg), dict(down or cfg)
    tma = bool(cfg.pop("USE_TMA", False)) | bool(down.pop("USE_TMA", False))
    return SGLangMoEConfig(cfg, down, "; ".join(files) or "default config", tma)


def align(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``moe_align_block_size`` (sorted_token_ids, expert_ids, num_tokens_post_padded)."""
    return sglang_modules.module("moe_align").moe_align_block_size(topk_ids, block_m, num_experts)[:3]


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gu: torch.Tensor,
              w_d: torch.Tensor, alignment: tuple, cfg: SGLangMoEConfig) -> torch.Tensor:
    """SGLang's unquantized fused MoE kernel sequence (module docstring) with a precomputed alignment.

    Args:
        x: [M, H] bf16 / fp16 activations. topk_ids: [M, k] int32. topk_weights: [M, k] fp32.
        w_gu: [E, 2I, H] gate then up. w_d: [E, H, I]. alignment: :func:`align`'s output at
            ``cfg.config["BLOCK_SIZE_M"]``. cfg: :func:`config`'s answer.

    Returns:
        [M, H] in ``x``'s dtype: Σ_k w_k · down_e(SiLU(gate_e x) · up_e x).

    Raises:
        ValueError: ``x`` is neither bf16 nor fp16 (SGLang's compute types).
    """
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"SGLang's fused MoE computes in bf16 / fp16, got {x.dtype}")
    import triton.language as tl

    k_mod = sglang_modules.import_peer(sglang_modules.importer(), _KERNELS)
    M, k = topk_ids.shape
    N, H = w_gu.shape[1], w_d.shape[1]
    compute = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    sorted_ids, expert_ids, ntpp = alignment
    flags = dict(compute_type=compute, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=False, per_channel_quant=False, block_shape=None)
    c1 = torch.empty(M * k, N, dtype=x.dtype, device=x.device)
    k_mod.invoke_fused_moe_kernel(x, w_gu, None, c1, None, None, None, topk_weights, topk_ids, sorted_ids,
                                  expert_ids, ntpp, False, k, cfg.config, **flags)
    c2 = torch.empty(M * k, N // 2, dtype=x.dtype, device=x.device)
    k_mod.act_and_mul_triton(c1, c2, cfg.config, topk_ids, expert_ids, False, "silu")
    c3 = torch.empty(M, k, H, dtype=x.dtype, device=x.device)
    k_mod.invoke_fused_moe_kernel(c2, w_d, None, c3, None, None, None, topk_weights, topk_ids, sorted_ids,
                                  expert_ids, ntpp, True, 1, cfg.down_config, router_topk=k, **flags)
    out = torch.empty(M, H, dtype=x.dtype, device=x.device)
    k_mod.moe_sum_reduce_triton(c3, out, 1.0)
    return out
