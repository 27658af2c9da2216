"""Readable twin of ``moe_lora_align_block_size`` and a strict checker of its output contract.

The contract (``moelora_core.align``, DESIGN.md §4). For each enabled adapter slot s, take the
(token, k) pairs whose token maps to s and whose expert id is in ``[0, E)``; group them by expert;
pad each expert's group with padding rows (value ``M * top_k``) to a multiple of ``BLOCK_M``; lay the
groups out one after another:

    sorted_token_ids[s, row]      = t * top_k + j   (pair index) or M * top_k (padding)
    expert_ids[s, row // BLOCK_M] = expert of that block, -1 past the last used block
    num_tokens_post_padded[s]     = Σ_e ceil(count[s, e] / BLOCK_M) * BLOCK_M

with the per-slot row capacity ``P = align_capacity(M, top_k, E, BLOCK_M)``. Pairs of tokens
mapped to ``NO_ADAPTER``, of disabled slots, or with expert ids < 0 or >= E appear nowhere. The
order of pairs within an expert is free (kernels use atomics).

Source: vLLM's ``moe_align_block_size`` (``vllm/model_executor/layers/fused_moe/moe_align_block_size.py``)
extended per LoRA slot as in vLLM's fused MoE-LoRA (vllm-project/vllm#21229) and SGLang's MoE-LoRA
(sgl-project/sglang#14105).

:func:`moe_lora_align_block_size` is the readable twin (loops, experts in ascending order, pairs in
ascending order within an expert). :func:`check_alignment` validates *any* implementation's output
against the contract semantically (per-(slot, expert) multisets, not row order), so the Triton
kernel is checked without assuming its atomics' order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from moelora_core.align import AlignOutput, align_capacity
from moelora_core.errors import InvalidFieldError
from moelora_core.sentinels import NO_ADAPTER, NO_EXPERT_BLOCK, padding_row


def _validated_inputs(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_m: int,
    max_loras: int,
    adapter_enabled: torch.Tensor | Sequence[int] | None,
) -> tuple[list[list[int]], list[int], list[int]]:
    """Host lists (ids [M][k], mapping [M], enabled [max_loras]) after checking the contract's inputs."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise InvalidFieldError("topk_ids", "must be a 2-D integer tensor [M, top_k]")
    M, k = topk_ids.shape
    if k < 1:
        raise InvalidFieldError("topk_ids", f"top_k must be >= 1, got shape {tuple(topk_ids.shape)}")
    if (
        not isinstance(token_lora_mapping, torch.Tensor)
        or token_lora_mapping.is_floating_point()
        or tuple(token_lora_mapping.shape) != (M,)
    ):
        raise InvalidFieldError("token_lora_mapping", f"must be an integer tensor of shape ({M},)")
    for name, value in (("num_experts", num_experts), ("block_m", block_m), ("max_loras", max_loras)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidFieldError(name, f"must be an int >= 1, got {value!r}")
    ids = [[int(e) for e in row] for row in topk_ids.tolist()]
    mapping = [int(s) for s in token_lora_mapping.tolist()]
    for t, slot in enumerate(mapping):
        if not NO_ADAPTER <= slot < max_loras:
            raise InvalidFieldError(f"token_lora_mapping[{t}]", f"slot {slot} is outside [-1, max_loras={max_loras})")
    if adapter_enabled is None:
        enabled = [1] * max_loras
    else:
        enabled = [int(v) for v in (adapter_enabled.tolist() if isinstance(adapter_enabled, torch.Tensor)
                                    else adapter_enabled)]
        if len(enabled) != max_loras:
            raise InvalidFieldError("adapter_enabled", f"needs max_loras={max_loras} entries, got {len(enabled)}")
    return ids, mapping, enabled


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_m: int,
    max_loras: int,
    adapter_enabled: torch.Tensor | Sequence[int] | None = None,
) -> AlignOutput:
    """Group each slot's (token, k) pairs by expert, padding every group to ``block_m`` rows.

    Args:
        topk_ids: [M, top_k] int expert ids (M = token capacity in graph mode). Ids < 0 or >= E
            are skipped.
        token_lora_mapping: [M] int slot per token, ``NO_ADAPTER`` (-1) = skipped.
        num_experts: E, the experts LoRA applies to.
        block_m: BLOCK_M, rows per block.
        max_loras: slots.
        adapter_enabled: [max_loras] 0/1, or None for all enabled; disabled slots stay empty.

    Returns:
        ``AlignOutput`` on the CPU: ``sorted_token_ids`` [max_loras, P] int32, ``expert_ids``
        [max_loras, P // block_m] int32, ``num_tokens_post_padded`` [max_loras] int32, with
        ``P = align_capacity(M, top_k, E, block_m)``. Experts in ascending order; pairs in ascending
        order within an expert.

    Raises:
        InvalidFieldError: malformed shapes, sizes < 1, a slot outside [-1, max_loras), or an
            ``adapter_enabled`` of the wrong length.
    """
    ids, mapping, enabled = _validated_inputs(
        topk_ids, token_lora_mapping, num_experts, block_m, max_loras, adapter_enabled
    )
    M, k = topk_ids.shape
    out = AlignOutput.empty(max_loras, M, k, num_experts, block_m)
    sorted_ids, expert_ids, post_padded = out
    for slot in range(max_loras):
        if not enabled[slot]:
            continue
        groups: dict[int, list[int]] = {e: [] for e in range(num_experts)}
        for t in range(M):
            if mapping[t] != slot:
                continue
            for j in range(k):
                e = ids[t][j]
                if 0 <= e < num_experts:
                    groups[e].append(t * k + j)
        row = 0
        for e in range(num_experts):
            pairs = groups[e]
            if not pairs:
                continue  # an empty expert takes no block
            num_blocks = -(-len(pairs) // block_m)
            for i, pair in enumerate(pairs):
                sorted_ids[slot, row + i] = pair
            for b in range(num_blocks):
                expert_ids[slot, row // block_m + b] = e
            row += num_blocks * block_m
        post_padded[slot] = row
    return out


def _expected_groups(
    ids: list[list[int]], mapping: list[int], enabled: list[int], num_experts: int, max_loras: int
) -> list[dict[int, Counter]]:
    """Per slot: expert → multiset of pair indices the contract puts there (an independent pass over
    pairs, not the twin's slot-major loop)."""
    k = len(ids[0]) if ids else 0
    groups: list[dict[int, Counter]] = [{} for _ in range(max_loras)]
    for pair in range(len(ids) * k):
        t, j = divmod(pair, k)
        slot, e = mapping[t], ids[t][j]
        if slot == NO_ADAPTER or not enabled[slot] or not 0 <= e < num_experts:
            continue
        groups[slot].setdefault(e, Counter())[pair] += 1
    return groups


def _describe_pair(pair: int, k: int, ids: list[list[int]], mapping: list[int], pad: int) -> str:
    if pair == pad:
        return "padding"
    if not 0 <= pair < pad:
        return f"out-of-range value {pair} (valid pairs are [0, {pad}), padding is {pad})"
    t, j = divmod(pair, k)
    return f"pair {pair} (token {t}, k {j}: slot {mapping[t]}, expert {ids[t][j]})"


def check_alignment(
    out: AlignOutput,
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_m: int,
    max_loras: int,
    adapter_enabled: torch.Tensor | Sequence[int] | None = None,
    seed: int | None = None,
    max_report: int = 12,
    check_disabled_slots: bool = True,
) -> None:
    """Validate any implementation's ``moe_lora_align_block_size`` output against the contract.

    Checks, per slot: dtypes int32 and shapes ``[max_loras, P]`` / ``[max_loras, P // block_m]`` /
    ``[max_loras]`` with ``P = align_capacity(M, top_k, E, block_m)``; ``num_tokens_post_padded``
    equals ``Σ_e ceil(count_e / block_m) * block_m``; every used block holds one expert in
    ``[0, E)`` and each expert's blocks are consecutive, ``ceil(count_e / block_m)`` of them; the
    multiset of pair indices in an expert's blocks equals the pairs routed to that (slot, expert)
    (each exactly once; order free); every other row in used blocks and every row past
    ``num_tokens_post_padded`` holds ``M * top_k``; blocks past the last used one hold -1.
    Disabled and unused slots are entirely padding with count 0 (disabled ones only where
    ``check_disabled_slots``).

    Args:
        out: the implementation's output (any device; read back here, this is a test helper).
        topk_ids, token_lora_mapping, num_experts, block_m, max_loras, adapter_enabled: the inputs
            the implementation was called with (as for :func:`moe_lora_align_block_size`).
        seed: echoed in the failure message so the case can be replayed.
        max_report: problems listed before the message is cut.
        check_disabled_slots: False skips the rows of disabled slots (``adapter_enabled[slot] == 0``):
            for an implementation whose consumer never reads them (capability
            ``alignment_reads_disabled_slots``; SGLang's JIT align leaves them untouched).

    Raises:
        AssertionError: listing each violation with its coordinates (slot, block, row) and the
            pair's token, k, slot and expert.
        InvalidFieldError: malformed inputs (as the twin).
    """
    ids, mapping, enabled = _validated_inputs(
        topk_ids, token_lora_mapping, num_experts, block_m, max_loras, adapter_enabled
    )
    M, k = topk_ids.shape
    pad = padding_row(M, k)
    cap = align_capacity(M, k, num_experts, block_m)
    num_blocks = cap // block_m
    problems: list[str] = []

    fields = {
        "sorted_token_ids": (out.sorted_token_ids, (max_loras, cap)),
        "expert_ids": (out.expert_ids, (max_loras, num_blocks)),
        "num_tokens_post_padded": (out.num_tokens_post_padded, (max_loras,)),
    }
    for name, (tensor, shape) in fields.items():
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(tensor).__name__})")
        elif tensor.dtype != torch.int32:
            problems.append(f"{name}: dtype {tensor.dtype}, expected torch.int32")
        elif tuple(tensor.shape) != shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
    if problems:
        _fail(problems, seed, max_report)

    rows = out.sorted_token_ids.detach().cpu().tolist()
    blocks = out.expert_ids.detach().cpu().tolist()
    counts = out.num_tokens_post_padded.detach().cpu().tolist()
    expected = _expected_groups(ids, mapping, enabled, num_experts, max_loras)

    for slot in range(max_loras):
        if not (enabled[slot] or check_disabled_slots):
            continue
        groups = expected[slot]
        want_blocks = {e: -(-sum(c.values()) // block_m) for e, c in groups.items()}
        want_rows = block_m * sum(want_blocks.values())
        state = "disabled" if not enabled[slot] else ("unused" if not groups else "used")
        if counts[slot] != want_rows:
            problems.append(
                f"slot {slot} ({state}): num_tokens_post_padded = {counts[slot]}, expected {want_rows} "
                f"(per expert blocks {dict(sorted(want_blocks.items()))}, block_m {block_m})"
            )
        used = want_rows // block_m
        # Blocks past the last used one: expert -1 and padding rows only.
        for b in range(used, num_blocks):
            if blocks[slot][b] != NO_EXPERT_BLOCK:
                problems.append(f"slot {slot} ({state}) block {b}: expert {blocks[slot][b]} past the last used block "
                                f"{used - 1}, expected {NO_EXPERT_BLOCK}")
        for r in range(want_rows, cap):
            if rows[slot][r] != pad:
                problems.append(f"slot {slot} ({state}) row {r} (past num_tokens_post_padded {want_rows}): "
                                f"{_describe_pair(rows[slot][r], k, ids, mapping, pad)}, expected padding {pad}")
        # Used blocks: one expert each, consecutive per expert, the right multiset of pairs.
        found: dict[int, Counter] = {}
        seen_blocks: Counter = Counter()
        last_expert = None
        finished: set[int] = set()
        for b in range(used):
            e = blocks[slot][b]
            if e not in groups:
                problems.append(f"slot {slot} block {b} (rows {b * block_m}..{(b + 1) * block_m - 1}): expert {e}, "
                                f"which has no pair in this slot (experts with pairs: {sorted(groups)})")
            if e != last_expert:
                if e in finished:
                    problems.append(f"slot {slot} block {b}: expert {e} resumes after other experts; "
                                    f"an expert's blocks must be consecutive")
                if last_expert is not None:
                    finished.add(last_expert)
                last_expert = e
            seen_blocks[e] += 1
            for r in range(b * block_m, (b + 1) * block_m):
                value = rows[slot][r]
                if value == pad:
                    continue
                if not 0 <= value < pad:
                    problems.append(f"slot {slot} block {b} row {r}: {_describe_pair(value, k, ids, mapping, pad)}")
                    continue
                t, j = divmod(value, k)
                if mapping[t] != slot or ids[t][j] != e:
                    problems.append(f"slot {slot} block {b} (expert {e}) row {r}: "
                                    f"{_describe_pair(value, k, ids, mapping, pad)} does not belong here")
                found.setdefault(e, Counter())[value] += 1
        for e, n in sorted(want_blocks.items()):
            if seen_blocks[e] != n:
                problems.append(f"slot {slot} expert {e}: {seen_blocks[e]} blocks, expected {n} "
                                f"(= ceil({sum(groups[e].values())} pairs / block_m {block_m}))")
        for e in sorted(set(groups) | set(found)):
            want, got = groups.get(e, Counter()), found.get(e, Counter())
            missing = sorted((want - got).elements())
            extra = sorted((got - want).elements())
            if missing:
                problems.append(f"slot {slot} expert {e}: missing pairs {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''} "
                                f"(first: {_describe_pair(missing[0], k, ids, mapping, pad)})")
            dup = sorted(p for p, c in got.items() if c > 1)
            if dup:
                problems.append(f"slot {slot} expert {e}: pairs written more than once {dup[:8]}")
            stray = sorted(set(extra) - set(dup))
            if stray:
                problems.append(f"slot {slot} expert {e}: pairs that belong elsewhere {stray[:8]}")
    if problems:
        _fail(problems, seed, max_report)


def _fail(problems: list[str], seed: int | None, max_report: int) -> None:
    head = f"moe_lora_align_block_size output violates the contract: {len(problems)} problem(s) (seed={seed})"
    lines = [head, *(f"  {p}" for p in problems[:max_report])]
    if len(problems) > max_report:
        lines.append(f"  ... and {len(problems) - max_report} more")
    raise AssertionError("\n".join(lines))
