"""``moe_lora_align_block_size``: group each adapter slot's (token, k) pairs by expert, pad to BLOCK_M.

Algorithm (``SPLIT`` programs per slot, each over a contiguous share of the pairs; no host sync;
grid ``(max_loras, SPLIT)``; ``SPLIT`` is the config key ``ALIGN_SPLIT`` of the row bucket):

1. count: stream the pairs in chunks; a pair belongs to this slot when
   ``token_lora_mapping[pair // top_k] == slot``, the slot is enabled and ``0 <= expert < E``;
   ``tl.histogram`` counts them per expert. With ``SPLIT == 1`` the one program counts all of its
   slot's pairs itself; with ``SPLIT > 1`` a first kernel writes one histogram per program into the
   workspace, and each program of the second kernel sums its slot's histograms and takes the
   counts of the parts before it as its offset within each expert (an exclusive prefix over parts).
2. layout: each expert's count is rounded up to BLOCK_M; an exclusive prefix sum gives each
   expert's first row. The program writes ``num_tokens_post_padded``, the expert of every block
   (``NO_EXPERT_BLOCK`` past the last used block) and the padding sentinel into every row that no
   pair will take (the tail of each expert's last block and every row past the last block). With
   ``SPLIT > 1`` every program derives the same layout and writes a strided share of it.
3. place: a per-(program, expert) cursor (scratch, starts at the expert's first row plus the
   earlier parts' counts) hands each pair of the program's share its row with an atomic add; the
   pair index is stored there. Rows written in 2 and 3, and rows of different parts, are disjoint.

Order within an expert is therefore free (the contract allows it): parts in order, within a part
the atomic order on a GPU, pair order under the interpreter. Why split: one program per slot
scans all M·top_k pairs twice and lays out every block alone, so at M·top_k in the thousands the
alignment is a serial chain on ``max_loras`` SMs (benchmarks/RESULTS.md, "What limits the misses").

Tensors (L = max_loras, P = capacity per slot, see :func:`moelora_core.align_capacity`):

- ``topk_ids`` [M, top_k] int32/int64: routed expert per pair; < 0 (EXPERT_NOT_HERE) or >= E are
  skipped (shared-expert ids in [E, E_base) get no LoRA).
- ``token_lora_mapping`` [M] int32: slot per token, NO_ADAPTER (-1) = none (graph tails are -1).
- ``adapter_enabled`` [L] int32 (optional): 0 = slot disabled, its pairs are skipped.
- ``sorted_token_ids`` [L, P] int32 (out): pair index ``t * top_k + j``; padding rows hold
  ``M * top_k``.
- ``expert_ids`` [L, P // BLOCK_M] int32 (out): expert per block, -1 past the last used block.
- ``num_tokens_post_padded`` [L] int32 (out): rows used per slot (multiple of BLOCK_M).
- ``workspace`` [L, 2, SPLIT, E_PAD] int32 (scratch): ``[:, 0]`` one histogram per program
  (``SPLIT > 1``), ``[:, 1]`` the next free row per (program, expert).

No rounding (integers only). Source: the alignment of vLLM's fused MoE (``moe_align_block_size``)
and its per-LoRA variant (vllm-project/vllm#21229); SGLang MoE-LoRA (sgl-project/sglang#14105).
"""

from __future__ import annotations

import torch

from moelora_core.align import AlignOutput, align_capacity
from moelora_core.errors import KernelPreconditionError
from moelora_kernels._align_kernels import _moe_lora_align_block_size_kernel, _moe_lora_align_count_kernel
from moelora_kernels._common import INDEX_DTYPES, check_positive_int, check_tensor, next_pow2, pdl_options
from moelora_kernels.configs import kernel_config

#: Most programs per slot the alignment takes (``ALIGN_SPLIT``): past a few dozen, each program's
#: share is a chunk or less and the per-program layout work dominates.
MAX_ALIGN_SPLIT = 64


def _check_outputs(out: AlignOutput, num_slots: int, capacity: int, block_m: int, device: torch.device) -> None:
    if not isinstance(out, AlignOutput):
        raise KernelPreconditionError(f"out: expected an AlignOutput, got {type(out).__name__}")
    check_tensor("out.sorted_token_ids", out.sorted_token_ids, dtypes=(torch.int32,), dim=2, contiguous=True,
                 device=device)
    rows = out.sorted_token_ids.shape[1]
    if out.sorted_token_ids.shape[0] != num_slots:
        raise KernelPreconditionError(
            f"out.sorted_token_ids: expected {num_slots} slot rows, got {out.sorted_token_ids.shape[0]}")
    if rows < capacity or rows % block_m:
        raise KernelPreconditionError(
            f"out.sorted_token_ids: {rows} rows per slot; need a multiple of BLOCK_M={block_m} and at least "
            f"the capacity {capacity} = round_up(M*top_k + E*(BLOCK_M-1), BLOCK_M)")
    check_tensor("out.expert_ids", out.expert_ids, dtypes=(torch.int32,), shape=(num_slots, rows // block_m),
                 contiguous=True, device=device)
    check_tensor("out.num_tokens_post_padded", out.num_tokens_post_padded, dtypes=(torch.int32,),
                 shape=(num_slots,), contiguous=True, device=device)


def align_split(num_pairs: int, config: dict | None = None, *, base: bool = False) -> int:
    """Programs per slot (``ALIGN_SPLIT``) of the alignment at ``num_pairs`` pairs, from the config
    table (op ``moe_lora_align_block_size``, or ``moe_align_block_size`` for the base alignment).

    Raises:
        KernelPreconditionError: a split that is not a power of two in [1, MAX_ALIGN_SPLIT].
    """
    return _checked_split(_align_config(num_pairs, config, base))


def _align_config(num_pairs: int, config: dict | None, base: bool) -> dict[str, int]:
    """The config of the base alignment (``base``: op ``moe_align_block_size``) or the per-slot one."""
    return kernel_config("moe_align_block_size" if base else "moe_lora_align_block_size", rows=num_pairs,
                         overrides=config)


def _checked_split(cfg: dict[str, int]) -> int:
    split = cfg["ALIGN_SPLIT"]
    if not isinstance(split, int) or split < 1 or split > MAX_ALIGN_SPLIT or split & (split - 1):
        raise KernelPreconditionError(f"ALIGN_SPLIT: must be a power of two in [1, {MAX_ALIGN_SPLIT}], got {split!r}")
    return split


def align_workspace_shape(num_slots: int, num_experts: int, split: int) -> tuple[int, int, int, int]:
    """Shape of the alignment's int32 scratch: [L, 2, SPLIT, next_pow2(max(E, 16))]."""
    return (num_slots, 2, split, next_pow2(num_experts, 16))


def _launch(topk_ids, token_lora_mapping, adapter_enabled, num_experts, block_m, num_slots, out, workspace, config,
            base):
    M, top_k = topk_ids.shape
    capacity = align_capacity(M, top_k, num_experts, block_m)
    if out is None:
        out = AlignOutput.empty(num_slots, M, top_k, num_experts, block_m, device=topk_ids.device)
    _check_outputs(out, num_slots, capacity, block_m, topk_ids.device)
    rows = out.sorted_token_ids.shape[1]
    num_pairs = M * top_k
    cfg = _align_config(num_pairs, config, base)  # one lookup for both keys
    split = _checked_split(cfg)
    # programmatic dependent launch (the op's ``PDL``): both kernels wait for the stream's previous grid
    # before their first load or write
    pdl = pdl_options(cfg, topk_ids.device)
    ws_shape = align_workspace_shape(num_slots, num_experts, split)
    e_pad = ws_shape[-1]
    if workspace is None:
        workspace = torch.empty(ws_shape, dtype=torch.int32, device=topk_ids.device)
    else:
        check_tensor("workspace", workspace, dtypes=(torch.int32,), shape=ws_shape, contiguous=True,
                     device=topk_ids.device)
    # Each of the slot's programs scans a contiguous share; chunks of pairs large enough that a
    # decode batch is one step, bounded so the [rows, E_PAD] comparison of the layout phase stays
    # in registers.
    pairs_per_part = max(1, -(-num_pairs // split))
    block_pairs = min(2048, next_pow2(pairs_per_part, 64))
    block_rows = max(16, min(256, 8192 // e_pad))
    dummy = out.num_tokens_post_padded
    mapping = token_lora_mapping if token_lora_mapping is not None else dummy
    enabled = adapter_enabled if adapter_enabled is not None else dummy
    flags = {"HAS_MAPPING": token_lora_mapping is not None, "HAS_ENABLED": adapter_enabled is not None}
    grid = (num_slots, split)
    if split > 1:
        _moe_lora_align_count_kernel[grid](
            topk_ids, mapping, enabled, workspace,
            num_pairs, top_k, num_experts, pairs_per_part,
            E_PAD=e_pad, SPLIT=split, BLOCK_PAIRS=block_pairs, **flags, **pdl, num_warps=4,
        )
    _moe_lora_align_block_size_kernel[grid](
        topk_ids, mapping, enabled,
        out.sorted_token_ids, out.expert_ids, out.num_tokens_post_padded, workspace,
        num_pairs, top_k, num_experts, rows, rows // block_m, pairs_per_part,
        out.sorted_token_ids.stride(0), out.expert_ids.stride(0),
        BLOCK_M=block_m, E_PAD=e_pad, SPLIT=split, BLOCK_PAIRS=block_pairs, BLOCK_ROWS=block_rows, **flags, **pdl,
        num_warps=8 if e_pad >= 128 else 4,
    )
    # In place on the caller's buffers: a static AlignOutput reused for a smaller batch says what
    # it holds now, and consumers refuse a launch on another pair count (its sentinel would be a pair).
    return out.set_launch(num_pairs, num_experts)


def _check_block_m(block_m: int) -> int:
    check_positive_int("block_m", block_m, minimum=16)
    if block_m & (block_m - 1):
        raise KernelPreconditionError(f"block_m: must be a power of two >= 16 (tl.dot tiles), got {block_m}")
    return block_m


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_m: int,
    max_loras: int,
    adapter_enabled: torch.Tensor | None = None,
    *,
    out: AlignOutput | None = None,
    workspace: torch.Tensor | None = None,
    config: dict | None = None,
) -> AlignOutput:
    """Align every slot's (token, k) pairs by expert into BLOCK_M-row blocks (contract in
    :mod:`moelora_core.align`). Writes every element of ``out``; no host sync.

    Args:
        topk_ids: [M, top_k] int32/int64, contiguous; M is the token capacity in graph mode.
        token_lora_mapping: [M] int32, slot per token (-1 = none).
        num_experts: E; ids outside [0, E) are skipped.
        block_m: rows per block, a power of two >= 16 (must equal the GEMMs' BLOCK_M:
            :func:`moelora_kernels.configs.moe_block_m` picks it).
        max_loras: L, slots.
        adapter_enabled: [L] int32 or None; 0 = skip the slot.
        out: caller-provided worst-case buffers (``AlignOutput.empty(L, M, top_k, E, block_m)``);
            allocated when None. Rows per slot may exceed the capacity (a larger graph bucket).
        workspace: int32 scratch of :func:`align_workspace_shape` (L, E, the split), allocated when None.
        config: overrides of the table entry (``{"ALIGN_SPLIT": n}``: programs per slot; ``PDL``:
            programmatic dependent launch, :func:`moelora_kernels._common.pdl_options`).

    Returns:
        ``out``, recording ``num_pairs = M * top_k`` (the padding sentinel) and ``num_experts``
        (``AlignOutput.set_launch``) for the consumers' host checks.

    Raises:
        KernelPreconditionError: wrong dtypes, shapes, devices or non-contiguous inputs; buffers
            below capacity; block_m not a power of two >= 16; bad sizes; an ``ALIGN_SPLIT`` that is
            not a power of two in [1, MAX_ALIGN_SPLIT]; a workspace of another shape; ``PDL`` not 0 / 1,
            or 1 below sm_90.
    """
    check_positive_int("num_experts", num_experts)
    check_positive_int("max_loras", max_loras)
    _check_block_m(block_m)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dim=2, contiguous=True)
    device = topk_ids.device
    check_tensor("token_lora_mapping", token_lora_mapping, dtypes=(torch.int32,), shape=(topk_ids.shape[0],),
                 contiguous=True, device=device)
    if adapter_enabled is not None:
        check_tensor("adapter_enabled", adapter_enabled, dtypes=(torch.int32,), shape=(max_loras,),
                     contiguous=True, device=device)
    return _launch(topk_ids, token_lora_mapping, adapter_enabled, num_experts, block_m, max_loras, out, workspace,
                   config, base=False)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    out: AlignOutput | None = None,
    workspace: torch.Tensor | None = None,
    config: dict | None = None,
) -> AlignOutput:
    """The base MoE's alignment: every pair in one "slot" (index 0), grouped by expert.

    Same kernel and contract as :func:`moe_lora_align_block_size` with ``max_loras = 1`` and no
    mapping; ``num_experts`` is E_base here (extra fused experts are real base experts).
    Virtual experts use it with ``num_experts = max_loras * E``.

    Returns:
        ``AlignOutput`` with a leading slot dimension of 1.

    Raises:
        KernelPreconditionError: as :func:`moe_lora_align_block_size`.
    """
    check_positive_int("num_experts", num_experts)
    _check_block_m(block_m)
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dim=2, contiguous=True)
    return _launch(topk_ids, None, None, num_experts, block_m, 1, out, workspace, config, base=True)
