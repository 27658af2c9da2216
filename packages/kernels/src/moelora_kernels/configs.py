"""Block configurations: one fixed config under the interpreter, tuned tables (data) on a GPU.

Configs live in JSON files next to this module, one per card (``configs/h200.json``,
``configs/h100.json``: :func:`table_path` picks the device's), keyed by operation, then by shape: an
entry matches when its ``N`` / ``K`` / ``R`` fields (when present) equal the call's,
and its ``max_rows`` is the smallest bound >= the call's row count (tokens × top_k, or tokens for
dense LoRA). The most specific matching entry wins; ``"default"`` entries match any shape.
``MOELORA_KERNEL_CONFIGS=/path/file.json`` replaces the shipped table (used when tuning).

Under ``TRITON_INTERPRET=1`` every lookup returns :data:`INTERPRETER_CONFIG`: multi-config
autotuning does not run there and the interpreter's cost is per program and per loop step, so
one config of 32-wide tiles keeps CPU runs short.

The alignment block size ``BLOCK_M`` is chosen here too (:func:`moe_block_m`), because the
alignment and every GEMM that reads it must agree on it. Small batches get ``BLOCK_M = 16``: with
a few rows per (adapter, expert) bucket, a 64- or 128-row block would be mostly padding.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from moelora_kernels._common import interpreting

#: The single config used under the Triton interpreter (tiles of 32; no pipelining).
INTERPRETER_CONFIG: dict[str, int] = {
    "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_S": 32, "N_SPLIT": 1, "FUSED": 1,
    "ALIGN_SPLIT": 1, "EXPAND_LOADS": 2,
    "EXPAND_STREAM": 0, "GROUP_SIZE_M": 0, "W_DESC": 0, "A_DESC": 0, "PDL": 0, "QUANT_ROWS": 1,
    "num_warps": 4, "num_stages": 1,
}

#: Used on a GPU when no table entry matches (and as the base every entry overrides).
GPU_FALLBACK_CONFIG: dict[str, int] = {
    "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_S": 32, "N_SPLIT": 1, "FUSED": 1,
    "ALIGN_SPLIT": 1, "EXPAND_LOADS": 0,
    "EXPAND_STREAM": 0, "GROUP_SIZE_M": 0, "W_DESC": 0, "A_DESC": 0, "PDL": 0, "QUANT_ROWS": 1,
    "num_warps": 4, "num_stages": 3,
}

_CONFIG_DIR = Path(__file__).parent / "configs"


@functools.lru_cache(maxsize=8)
def _load_table(path: str) -> dict[str, list[dict]]:
    with open(path) as f:
        table = json.load(f)
    return {op: list(entries) for op, entries in table.items() if not op.startswith("_")}


#: The table of each card with one of its own (a device name containing the key, lower case); any other
#: device gets the H200's, the card every entry of it was measured on.
CARD_TABLES: dict[str, str] = {"h100": "h100.json", "h200": "h200.json"}
DEFAULT_TABLE = "h200.json"


def table_path(device_name: str) -> Path:
    """The shipped table for a device named ``device_name`` (``torch.cuda.get_device_name()``, e.g.
    "NVIDIA H100 80GB HBM3"): :data:`CARD_TABLES`' file whose key the name contains, else
    :data:`DEFAULT_TABLE`."""
    name = device_name.lower()
    return _CONFIG_DIR / next((f for card, f in CARD_TABLES.items() if card in name), DEFAULT_TABLE)


@functools.lru_cache(maxsize=1)
def device_table_path() -> str:
    """The shipped table of this process's CUDA device (:func:`table_path`; the default without one)."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return str(table_path(name))


def _table() -> dict[str, list[dict]]:
    path = os.environ.get("MOELORA_KERNEL_CONFIGS") or device_table_path()
    return _load_table(path)


def kernel_config(op: str, *, rows: int, N: int | None = None, K: int | None = None,
                  R: int | None = None, overrides: dict | None = None,
                  fallback_op: str | None = None) -> dict[str, int]:
    """Tile sizes and launch options for ``op`` at this shape.

    Args:
        op: table key (``fused_moe_gemm``, ``fused_moe_lora``, ``moe_lora_shrink``,
            ``moe_lora_expand``, ``dense_lora_shrink``, ``dense_lora_expand``; ``moe_lora_path``,
            whose ``FUSED`` says whether :func:`moelora_kernels.moe_lora_delta` runs the fused
            kernel or the shrink/expand pair at this size; ``fused_moe_lora``'s
            ``EXPAND_LOADS`` (0, 1, 2) says when each expand tile's B and old output are loaded;
            ``EXPAND_STREAM`` (0-4) of ``moe_lora_expand`` and ``fused_moe_lora``, how the expand
            reads its factor tiles (0: exact rank masks; 1: 16-byte loads; >= 2: also a pipelined
            expand loop that many stages deep, ``moelora_kernels.expand_stream``);
            ``moe_lora_align_block_size`` / ``moe_align_block_size``, whose ``ALIGN_SPLIT`` is the
            alignment's programs per slot; ``fused_moe_gemm``'s ``GROUP_SIZE_M``, its program order,
            and ``W_DESC``, its weight tiles through a TMA descriptor (``fused_moe.weight_descriptor``);
            ``A_DESC`` of ``moe_lora_shrink`` and ``fused_moe_lora``, the shrink's A tiles through one
            (``moe_lora.lora_a_descriptor``); ``PDL`` of every op a fused MoE layer launches (the two
            alignments, ``fused_moe_gemm``, ``quantize_activation_fp8``, ``moe_epilogue``: the activation and
            the top-k sum, and the three MoE-LoRA kernels), programmatic dependent launch
            (``_common.PDL_OPS``, ``_common.pdl_options``);
            ``fp8_moe_gemm``, the w8a8 base GEMM's tiles, whose ``BLOCK_M`` is its alignment's;
            ``quantize_activation_fp8``'s ``QUANT_ROWS``, rows per program).
        rows: host row count the launch is sized for (a capacity in graph mode).
        N, K: output width and reduction depth; R: the LoRA rank bound.
        overrides: a launcher's ``config`` argument: entries that replace the looked-up ones.
        fallback_op: looked up first, ``op``'s matching entry then replacing the keys it holds (the fp8
            GEMM takes the bf16 GEMM's tiles where its own entries hold none, e.g. an empty entry
            that keeps small batches as they were).

    Returns:
        A fresh dict with every key of :data:`GPU_FALLBACK_CONFIG` (``BLOCK_M`` is advisory for
        GEMMs: they take the alignment's), ``overrides`` applied last.
    """
    if fallback_op is None:
        out = _looked_up(op, rows, N, K, R)
    else:
        out = _looked_up(fallback_op, rows, N, K, R)
        own = None if interpreting() else _matched_entry(op, rows, N, K, R)
        out.update({k: v for k, v in (own or {}).items() if k in GPU_FALLBACK_CONFIG})
    if overrides:
        out.update(overrides)
    return out


def _looked_up(op: str, rows: int, N: int | None, K: int | None, R: int | None) -> dict[str, int]:
    if interpreting():
        return dict(INTERPRETER_CONFIG)
    best = _matched_entry(op, rows, N, K, R)
    out = dict(GPU_FALLBACK_CONFIG)
    if best is not None:
        out.update({k: v for k, v in best.items() if k in GPU_FALLBACK_CONFIG})
    return out


def _matched_entry(op: str, rows: int, N: int | None = None, K: int | None = None,
                   R: int | None = None) -> dict | None:
    """The table entry of ``op`` that matches the call (module doc), as stored, or None."""
    best: dict | None = None
    best_key: tuple[int, int] | None = None
    for entry in _table().get(op, []):
        shape_keys = [k for k in ("N", "K", "R") if k in entry]
        call = {"N": N, "K": K, "R": R}
        if any(entry[k] != call[k] for k in shape_keys):
            continue
        max_rows = entry.get("max_rows", 1 << 62)
        if rows > max_rows:
            continue
        # more shape keys = more specific; then the tightest row bucket
        key = (-len(shape_keys), max_rows)
        if best_key is None or key < best_key:
            best, best_key = entry, key
    return best


def base_moe_block_m(num_tokens: int, top_k: int, num_experts: int, *, fp8: bool = False) -> int:
    """``BLOCK_M`` of the base fused MoE's alignment, as ``moelora_kernels.fused_moe`` picks it: each base
    GEMM's own measured entries (``moe_align_block_size``'s for the bf16 / fp16 GEMM, ``fp8_moe_gemm``'s for
    the w8a8 one, ``fp8``), else :func:`moe_block_m`'s rule. Args as :func:`moe_block_m`."""
    return moe_block_m(num_tokens, top_k, num_experts, op="fp8_moe_gemm" if fp8 else "moe_align_block_size")


#: The alignment block sizes a table entry may choose (``BLOCK_M`` of ``moe_align_block_size``).
TABLE_BLOCK_M: tuple[int, ...] = (16, 32, 64, 128)


def moe_block_m(num_tokens: int, top_k: int, num_experts: int, max_loras: int = 1, *,
                op: str | None = None) -> int:
    """``BLOCK_M`` for an alignment and the MoE GEMMs that read its output.

    Sized from the expected rows per (slot, expert) bucket, ``num_tokens * top_k / (max_loras *
    num_experts)``: 16 while buckets hold a few rows (decode, small prefill), 32 / 64 as they
    fill. With ``op``, a ``BLOCK_M`` stored in that op's matching table entry (rows = ``num_tokens *
    top_k``) wins: the base MoE's alignment (``op="moe_align_block_size"``, bf16 / fp16 base GEMMs)
    takes 128 where ``sweep_configs.py --block-m`` measured it faster with that entry's GEMM tiles.
    Under the interpreter: 32 (the interpreter's cost is per program).

    Args:
        num_tokens: M, tokens of the batch (its capacity in graph mode).
        top_k: experts per token.
        num_experts: experts the alignment groups by (``max_loras * E`` for virtual experts).
        max_loras: slots the tokens spread over (1 for the base MoE and virtual experts).
        op: the table operation whose entries may store ``BLOCK_M`` (one of :data:`TABLE_BLOCK_M`).
    """
    if interpreting():
        return INTERPRETER_CONFIG["BLOCK_M"]
    entry = _matched_entry(op, num_tokens * top_k) if op is not None else None
    if entry is not None and "BLOCK_M" in entry:
        return entry["BLOCK_M"]
    rows_per_bucket = num_tokens * top_k / max(1, num_experts * max_loras)
    if rows_per_bucket <= 16:
        return 16
    if rows_per_bucket <= 48:
        return 32
    return 64
