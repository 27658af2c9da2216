"""Exact checks of a backend's batch metadata (property 7; DESIGN.md §3, §4).

Against the batch's host lists (what any correct backend must derive):

- per token: ``token_lora_mapping[:T]`` = the requests expanded (``NO_ADAPTER`` for base requests
  and rank-0 slots); graph tail -1;
- the request segments, whatever the backend's segmentation: ``req_seg_indptr`` = the offsets
  (graph tail = the last live offset), ``req_weight_indices`` = the slots (graph tail -1);
  ``adapter_enabled`` per slot;
- host fields: ``has_active_lora`` (eager: from the host lists; graph: True), ``use_cuda_graph``,
  the token count (eager: the batch's; graph: the capacity of the bucket it was prepared for);
- the backend segmentation (backend-specific, so checked by invariants): offsets start at 0 and
  never decrease, slots lie in [-1, L), the permutation (if any) is a permutation of the rows, and
  every token with an adapter lies in exactly one segment of its slot *among the first*
  ``num_segments`` (the segments a launch iterates over), no longer than ``max_len``, while no other
  row (base token or pad row) lies in a segment with a slot;
- the MoE alignment: every block of ``BLOCK_M`` rows holds one (slot, expert), each routed pair
  exactly once (``moelora_reference.align.check_alignment``), on the backend's own alignment when
  it exposes one (``backend.moe_alignment(topk_ids, info) -> (AlignOutput, block_m)``), else on
  the reference twin run on the backend's metadata; disabled slots' rows only where the backend's
  consumer reads them (capability ``alignment_reads_disabled_slots``, default True).
"""

from __future__ import annotations

import torch

from moelora_conformance.harness.checks import CheckContext
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.tolerance import assert_exact
from moelora_reference.align import check_alignment, moe_lora_align_block_size

I32 = torch.int32


def metadata_tensors(info: LoRABatchInfo) -> dict[str, torch.Tensor]:
    """Every device tensor of ``info`` by name: the protocol's fields (``device_tensors``) and the
    tensors of the backend's private metadata (``private.<key>``; in graph mode they are static
    buffers too, DESIGN.md §5)."""
    out = dict(info.device_tensors())
    out.update({f"private.{k}": v for k, v in info.private.items() if isinstance(v, torch.Tensor)})
    return out


def _exact(actual: torch.Tensor, expected: list, ctx: CheckContext, what: str, dtype=I32) -> None:
    assert_exact(actual.detach().cpu(), torch.tensor(expected, dtype=dtype), what=ctx.what(what), seed=ctx.seed)


def check_batch_metadata(info: LoRABatchInfo, batch: BatchSpec, ctx: CheckContext, *, graph: bool,
                         num_experts: int, max_loras: int) -> None:
    """Every per-token, per-request and per-slot field of ``info`` equals what ``batch`` says, tails
    included in graph mode (module docstring).

    Raises:
        AssertionError: naming the field, the first differing entries and the seed.
    """
    T, bs = batch.num_tokens, batch.bs
    if info.use_cuda_graph != graph:
        raise AssertionError(ctx.what(f"use_cuda_graph is {info.use_cuda_graph}, expected {graph}"))
    expected_active = True if graph else batch.has_active_lora
    if info.has_active_lora != expected_active:
        raise AssertionError(ctx.what(f"has_active_lora is {info.has_active_lora}, expected {expected_active} "
                                      f"({'graph metadata records the LoRA kernels' if graph else 'from host lists'})"))
    rows = info.token_lora_mapping.numel()
    req_cap = info.req_weight_indices.numel()
    if info.num_tokens != rows:
        raise AssertionError(ctx.what(f"num_tokens {info.num_tokens} is not the token map's {rows} rows"))
    if info.req_seg_indptr.numel() != req_cap + 1 or info.adapter_enabled.numel() != max_loras:
        raise AssertionError(ctx.what(f"req_seg_indptr has {info.req_seg_indptr.numel()} entries for {req_cap} "
                                      f"requests; adapter_enabled {info.adapter_enabled.numel()} for {max_loras} "
                                      "slots"))
    if graph:
        if rows < T or req_cap < bs:
            raise AssertionError(ctx.what(f"graph metadata holds {rows} tokens / {req_cap} requests, the batch "
                                          f"needs {T} / {bs}"))
    elif rows != T or req_cap != bs:
        raise AssertionError(ctx.what(f"eager metadata sized {rows} tokens / {req_cap} requests; the batch has "
                                      f"{T} / {bs}"))
    mapping = list(batch.token_lora_mapping) + [-1] * (rows - T)
    _exact(info.token_lora_mapping, mapping, ctx, "token_lora_mapping (tail -1)")
    offsets = list(batch.req_seg_indptr) + [T] * (req_cap - bs)
    slots = list(batch.req_weight_indices) + [-1] * (req_cap - bs)
    _exact(info.req_seg_indptr, offsets, ctx, "req_seg_indptr (tail = last live offset)")
    _exact(info.req_weight_indices, slots, ctx, "req_weight_indices (tail -1)")
    _exact(info.adapter_enabled, list(batch.adapter_enabled), ctx, "adapter_enabled")
    check_segments(info, batch, ctx)


def check_segments(info: LoRABatchInfo, batch: BatchSpec, ctx: CheckContext) -> None:
    """The dense segmentation's invariants (module docstring)."""
    indptr = info.seg_indptr.detach().cpu().tolist()
    slots = info.weight_indices.detach().cpu().tolist()
    S = len(slots)
    lens = [indptr[i + 1] - indptr[i] for i in range(min(S, len(indptr) - 1))]
    rows = info.token_lora_mapping.numel()
    problems = []
    if len(indptr) != S + 1:
        problems.append(f"seg_indptr has {len(indptr)} entries for {S} segments")
    else:
        if indptr[0] != 0:
            problems.append(f"seg_indptr[0] = {indptr[0]}")
        for i in range(S):
            if indptr[i + 1] < indptr[i]:
                problems.append(f"seg_indptr decreases at {i}: {indptr[i]} -> {indptr[i + 1]}")
            if not -1 <= slots[i] < batch.max_loras:
                problems.append(f"weight_indices[{i}] = {slots[i]} outside [-1, {batch.max_loras})")
        if indptr[-1] > rows:
            problems.append(f"segments reach row {indptr[-1]} past the {rows} token rows")
    perm = list(range(rows)) if info.permutation is None else info.permutation.detach().cpu().tolist()
    if info.permutation is not None and sorted(perm) != list(range(len(perm))):
        problems.append(f"permutation is not a permutation of its {len(perm)} rows")
    launched = info.num_segments
    if not 0 <= launched <= S:
        problems.append(f"num_segments = {launched} outside [0, {S}] (the segment buffers' length)")
    if not problems:
        covered = [0] * rows
        mapping = list(batch.token_lora_mapping) + [-1] * (rows - batch.num_tokens)
        for i in range(S):
            if slots[i] < 0:
                continue
            if lens[i] and i >= launched:
                problems.append(f"segment {i} (slot {slots[i]}, {lens[i]} tokens) lies past num_segments = "
                                f"{launched}: no launch reaches it")
                continue
            if lens[i] > info.max_len:
                problems.append(f"segment {i} has {lens[i]} tokens > max_len = {info.max_len}")
            for pos in range(indptr[i], indptr[i + 1]):
                row = perm[pos] if pos < len(perm) else -1
                if not 0 <= row < rows:
                    problems.append(f"segment {i} reads row {row} outside [0, {rows})")
                    continue
                covered[row] += 1
                if mapping[row] != slots[i]:
                    problems.append(f"segment {i} (slot {slots[i]}) covers row {row} whose slot is {mapping[row]}")
        for row, slot in enumerate(mapping):
            if slot >= 0 and covered[row] != 1:
                problems.append(f"token {row} (slot {slot}) lies in {covered[row]} segments with an adapter")
    if problems:
        head = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise AssertionError(ctx.what(f"dense segmentation: {head}") + f" (seed={ctx.seed})")


def check_moe_alignment(backend, info: LoRABatchInfo, batch: BatchSpec, topk_ids: torch.Tensor, ctx: CheckContext,
                        *, num_experts: int, max_loras: int, block_m: int = 16) -> str:
    """Every alignment block holds one expert and every routed pair appears once (the contract of
    DESIGN.md §4), for the backend's own alignment if it exposes ``moe_alignment``. Disabled slots
    are checked too unless the backend declares ``alignment_reads_disabled_slots=False`` (its
    consumer never reads them).

    Args:
        topk_ids: [rows, k] ids of every token row of ``info`` (pad rows included in graph mode).

    Returns:
        "backend" or "twin": whose alignment was checked.
    """
    rows = info.token_lora_mapping.numel()
    expected_mapping = torch.tensor(list(batch.token_lora_mapping) + [-1] * (rows - batch.num_tokens), dtype=I32)
    enabled = list(batch.adapter_enabled)
    hook = getattr(backend, "moe_alignment", None)
    strict = True
    if callable(hook):
        out, block_m = hook(topk_ids, info)
        source = "backend"
        strict = backend.capabilities().alignment_reads_disabled_slots
    else:
        out = moe_lora_align_block_size(topk_ids.cpu(), info.token_lora_mapping.cpu(), num_experts, block_m,
                                        max_loras, info.adapter_enabled.cpu())
        source = "twin"
    try:
        check_alignment(out, topk_ids.cpu(), expected_mapping, num_experts, block_m, max_loras, enabled, seed=ctx.seed,
                        check_disabled_slots=strict)
    except AssertionError as exc:
        raise AssertionError(ctx.what(f"MoE alignment ({source}, BLOCK_M={block_m})") + f": {exc}") from None
    return source
