"""Batch metadata handed from a backend's ``prepare`` to its delta calls (DESIGN.md §3).

One field per concept a kernel reads, one name each (the names of SGLang's LoRA backends,
``LoRABatchInfo`` in ``sglang/srt/lora/utils.py``, and of the MoE-LoRA PRs; the semantics are
moelora's contract):

- a **slot** is an index into the adapter pool (``LoRAWeights``), ``NO_ADAPTER`` (-1) = none;
- **request segments** (``req_seg_indptr``, ``req_weight_indices``): one segment per request, in
  batch order, whatever the backend's segmentation; the token map is built from them;
- **backend segments** (``seg_indptr``, ``weight_indices``, ``permutation``, ``num_segments``,
  ``max_len``): the segmentation the backend's dense kernels iterate over (requests, adapters,
  tiles or chunks); where the backend segments by request they are the request tensors themselves;
- the **token map** ``token_lora_mapping``: the slot of every token row, built once per batch on the
  device from the request segments (the one source every reader uses);
- **ranks and σ** are not batch metadata: kernels read them per module from the pool
  (``LoRAWeights.ranks(module)`` / ``LoRAWeights.scalings(module)``), written at slot load, so no
  batch copies them.

Host fields vs device fields: host fields are Python values a kernel launch uses (grid sizes,
loop bounds). In graph mode (``use_cuda_graph=True``) every host number is the *capacity* of the
bucket the info was prepared for, fixed at capture, and the kernels read the live counts from the
device tensors, whose unused tails are reset (offsets to the last live offset, slots and the token
map to -1). Device fields of a graph-mode info are views of the backend's static buffers of that
graph family (one set per family, allocated at its largest bucket): their ``data_ptr`` never
changes, and two buckets' views start at the same address.

Names of the previous version of this type (``moe``, ``bs``, ``forward_mode``, ``seg_lens``,
``lora_ranks``, ``scalings``, ``MoELoRABatchInfo``) raise :class:`~moelora_core.errors.RenamedError`
naming their replacement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

import torch

from moelora_core.errors import RenamedError, RenamedImportError

#: Fields of the previous ``LoRABatchInfo`` / ``MoELoRABatchInfo`` → what replaces them.
REMOVED_FIELDS: dict[str, str] = {
    "moe": "the MoE fields are LoRABatchInfo's own: token_lora_mapping, adapter_enabled; the per-request "
           "fields are req_seg_indptr / req_weight_indices (moe.seg_indptr, moe.req_to_lora); num_experts and "
           "max_loras are the backend's spec (spec.E, spec.max_loras)",
    "bs": "req_weight_indices.numel() (the request count; graph mode: the bucket's request capacity)",
    "forward_mode": "the BatchSpec's forward_mode, read in prepare (keep it in private if a delta needs it)",
    "seg_lens": "seg_indptr[1:] - seg_indptr[:-1] (read by no kernel)",
    "lora_ranks": "LoRAWeights.ranks(module) (per module, read by the kernels from the pool)",
    "scalings": "LoRAWeights.scalings(module) (per module σ, fp32, read by the kernels from the pool)",
    "req_to_lora": "req_weight_indices",
}


@dataclass(init=False)
class LoRABatchInfo:
    """Metadata for one batch, produced by ``Backend.prepare`` from a ``BatchSpec`` (module doc).

    Attributes (T = ``num_tokens``, bs requests, S = the backend segments' length, L slots; who reads
    each in the built-in backends in brackets):

        num_tokens: host int T; token rows (graph mode: the bucket's token capacity, the row count of
            the static activations) [every delta call's shape checks; the Triton launches' row count].
        req_seg_indptr: device int32 [bs + 1]; token offsets of each request. Graph tails equal the
            last live offset (empty requests) [the token mapper].
        req_weight_indices: device int32 [bs]; slot of each request, ``NO_ADAPTER`` for base requests
            and rank-0 slots. Graph tails -1 [the token mapper].
        token_lora_mapping: device int32 [T]; slot of every token row, -1 = none; graph tails -1, so
            pad rows add nothing [every MoE and dense delta; the alignment].
        adapter_enabled: device int32 [L]; 1 where a slot has tokens in this batch. Kernels exit
            early for programs of disabled slots [MoE-LoRA kernels, alignment, reference].
        num_segments: host int S; backend segments a dense launch iterates over (graph mode: the
            bucket's capacity). ``triton``: one per request in EXTEND, one per adapter in DECODE,
            16-token tiles in the prefill graph; ``csgmv``: adapter-sorted chunks; ``reference``:
            one per request [dense kernels].
        max_len: host int; longest backend segment (graph mode: the bound, e.g. the tile or chunk
            size) [dense kernels].
        seg_indptr: device int32 [S + 1]; token offsets of the backend segments (in permuted order
            where ``permutation`` is set); graph tails equal the last live offset. The request
            offsets themselves where the backend segments by request [dense kernels].
        weight_indices: device int32 [S]; slot of each backend segment, -1 = no adapter; graph tails
            -1 [dense kernels].
        permutation: device int64 [T] or None; ``permutation[i]`` is the token row read at sorted
            position i (csgmv always; triton in DECODE). Graph tails map pad rows to themselves
            [dense kernels].
        has_active_lora: host bool; True if any token uses an adapter (from host lists). True during
            graph capture so the LoRA kernels are recorded; they exit early on device [every delta].
        use_cuda_graph: host bool; whether device fields are static graph buffers [rank bounds].
        private: the backend's own metadata for this batch (any keys; the suite and the engine never
            read or write it). In graph mode its tensors must be static buffers too.

    Raises:
        RenamedError: a keyword of the previous version (``moe=``, ``seg_lens=``, ...), naming what
            replaces it.
    """

    num_tokens: int
    req_seg_indptr: torch.Tensor
    req_weight_indices: torch.Tensor
    token_lora_mapping: torch.Tensor
    adapter_enabled: torch.Tensor
    num_segments: int
    max_len: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    permutation: torch.Tensor | None
    has_active_lora: bool
    use_cuda_graph: bool
    private: dict[str, Any] = field(default_factory=dict)

    def __init__(self, **fields: Any) -> None:
        # Keyword-only, checked here so that a call of the previous version (moe=..., seg_lens=...) is
        # told what replaces the old field before anything else.
        for name in fields:
            if name in REMOVED_FIELDS:
                raise RenamedError(f"LoRABatchInfo({name}=...)", REMOVED_FIELDS[name])
        known = {f.name for f in dataclass_fields(LoRABatchInfo)}
        unknown, missing = set(fields) - known, known - set(fields) - {"private"}
        if unknown or missing:
            raise TypeError(f"LoRABatchInfo: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        for name, value in fields.items():
            setattr(self, name, value)
        if "private" not in fields:
            self.private = {}

    def __getattr__(self, name: str) -> Any:
        # Only called for names the instance does not have: the previous version's fields say what
        # replaces them.
        if name in REMOVED_FIELDS:
            raise RenamedError(f"LoRABatchInfo.{name}", REMOVED_FIELDS[name])
        raise AttributeError(f"'LoRABatchInfo' object has no attribute {name!r}")

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor of the info by field name (for address and tail checks); backend
        segments that are the request tensors appear under both names."""
        names = ("req_seg_indptr", "req_weight_indices", "token_lora_mapping", "adapter_enabled", "seg_indptr",
                 "weight_indices", "permutation")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def __getattr__(name: str) -> Any:
    if name == "MoELoRABatchInfo":
        raise RenamedImportError("moelora_core.batch_info.MoELoRABatchInfo", REMOVED_FIELDS["moe"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
