"""The shipped block-config tables (``configs/h200.json``, ``configs/h100.json``) as data: every key of every entry is one
the lookup reads (``kernel_config`` drops unknown keys, so a misspelt ``ALIGN_SPLT`` pasted from a
sweep would silently select the default), and the variant keys hold values their launchers accept;
``moe_lora_delta`` looks its path up with the stage's N (so an entry may pick the path per stage)."""

import pytest
import torch
from kernel_testing import DEVICE
from moe_lora_testing import make_pool, run_delta, stage_inputs

from moelora_kernels import configs, moe_lora, moe_lora_align_block_size
from moelora_kernels._common import PDL, PDL_OPS
from moelora_kernels.align import MAX_ALIGN_SPLIT
from moelora_kernels.expand_stream import EXPAND_STREAM
from moelora_kernels.fused_moe import MAX_GROUP_SIZE_M
from moelora_kernels.moe_lora import A_DESC, EXPAND_LOADS

SHAPE_KEYS = {"N", "K", "R", "max_rows"}


def _entries():
    out = []
    for name in sorted(set(configs.CARD_TABLES.values())):
        table = configs._load_table(str(configs._CONFIG_DIR / name))
        out += [(op, e) for op, entries in table.items() for e in entries]
    return out


def test_each_card_gets_its_own_table_and_other_devices_the_h200s():
    assert configs.table_path("NVIDIA H100 80GB HBM3").name == "h100.json"
    assert configs.table_path("NVIDIA H200").name == "h200.json"
    assert configs.table_path("NVIDIA A100-SXM4-80GB").name == configs.DEFAULT_TABLE == "h200.json"
    assert configs.table_path("").name == "h200.json"  # no CUDA device
    for name in set(configs.CARD_TABLES.values()):
        assert (configs._CONFIG_DIR / name).is_file(), name


@pytest.mark.parametrize("op, entry", _entries(), ids=lambda v: v if isinstance(v, str) else "")
def test_shipped_entries_use_only_known_keys_and_valid_values(op, entry):
    unknown = set(entry) - SHAPE_KEYS - set(configs.GPU_FALLBACK_CONFIG)
    assert not unknown, f"{op} entry {entry}: keys the lookup ignores: {sorted(unknown)}"
    for key, v in entry.items():  # FUSED / W_DESC / A_DESC / PDL are 0/1 flags, EXPAND_LOADS / EXPAND_STREAM values from 0,
        flag = key in ("FUSED", "EXPAND_LOADS", "EXPAND_STREAM", "W_DESC", "A_DESC", "PDL")  # others positive ints
        assert isinstance(v, int) and v >= (0 if flag else 1), f"{op} entry {entry}: {key}={v!r}"
    if "EXPAND_LOADS" in entry:
        assert op == "fused_moe_lora" and entry["EXPAND_LOADS"] in EXPAND_LOADS, f"{op} entry {entry}"
    if "EXPAND_STREAM" in entry:
        assert op in ("moe_lora_expand", "fused_moe_lora") and entry["EXPAND_STREAM"] in EXPAND_STREAM, (
            f"{op} entry {entry}")
    if "QUANT_ROWS" in entry:
        rows = entry["QUANT_ROWS"]
        assert op == "quantize_activation_fp8" and not rows & (rows - 1), f"{op} entry {entry}"
    if "GROUP_SIZE_M" in entry:
        assert op == "fused_moe_gemm" and 1 <= entry["GROUP_SIZE_M"] <= MAX_GROUP_SIZE_M, f"{op} entry {entry}"
    if "W_DESC" in entry:
        assert op == "fused_moe_gemm" and entry["W_DESC"] in (0, 1), f"{op} entry {entry}"
    if "A_DESC" in entry:
        assert op in ("moe_lora_shrink", "fused_moe_lora") and entry["A_DESC"] in A_DESC, f"{op} entry {entry}"
    if "PDL" in entry:
        assert op in PDL_OPS and entry["PDL"] in PDL, f"{op} entry {entry}"
    if "BLOCK_M" in entry:  # the base alignment's block rows (configs.moe_block_m(op=...)); GEMMs take the alignment's
        assert op in ("moe_align_block_size", "fp8_moe_gemm") and entry["BLOCK_M"] in configs.TABLE_BLOCK_M, (
            f"{op} entry {entry}")
    if op == "fp8_moe_gemm":  # BLOCK_K is the weights' K-group; BLOCK_M is read without N / K (one alignment)
        assert "BLOCK_K" not in entry and not ("BLOCK_M" in entry and {"N", "K"} & set(entry)), f"{op} entry {entry}"
    if "ALIGN_SPLIT" in entry:
        split = entry["ALIGN_SPLIT"]
        assert op in ("moe_lora_align_block_size", "moe_align_block_size"), f"{op} entry {entry}"
        assert 1 <= split <= MAX_ALIGN_SPLIT and not split & (split - 1), f"{op} entry {entry}"


@pytest.mark.interpreter
@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_moe_lora_path_is_looked_up_with_the_stages_N(stage, monkeypatch):
    # a moe_lora_path entry keyed by N picks the path of one stage (gate_up N = I, down N = H), so a
    # fused gate_up can ship next to a down stage on the pair
    seen = []

    def spy(op, **kw):
        seen.append((op, kw))
        return configs.kernel_config(op, **kw)

    monkeypatch.setattr(moe_lora, "kernel_config", spy)
    w = make_pool(35, L=1, E=3, H=40, I=24, R=8)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1]], dtype=torch.int32, device=DEVICE)
    mapping = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    align = moe_lora_align_block_size(ids, mapping, 3, 32, 1)
    gen = torch.Generator().manual_seed(35)
    x, out, tw = stage_inputs(gen, stage, 3, 2, 40, 24, torch.float32, torch.rand(3, 2, generator=gen).to(DEVICE))
    run_delta(stage, x, out, w, align, 2, tw, None, fused=None)
    paths = [kw for op, kw in seen if op == "moe_lora_path"]
    assert paths == [{"rows": 6, "N": 24 if stage == "gate_up" else 40, "R": 8}], seen


def test_base_block_m_comes_from_the_h100_table_where_it_was_measured(monkeypatch):
    """The H100 table's base alignment takes BLOCK_M 128 above 8192 rows (tokens × top_k) and the rule's
    block elsewhere; the LoRA alignments (no ``op``) and virtual experts always take the rule's."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", str(configs._CONFIG_DIR / "h100.json"))
    base = "moe_align_block_size"
    rule = {M: configs.moe_block_m(M, 8, 128) for M in (1, 512, 1024, 1025, 2048, 8192)}
    assert rule == {1: 16, 512: 32, 1024: 64, 1025: 64, 2048: 64, 8192: 64}
    assert {M: configs.moe_block_m(M, 8, 128, op=base) for M in rule} == {**rule, 1025: 128, 2048: 128, 8192: 128}
    assert configs.moe_block_m(8192, 8, 128, 4) == 64  # the LoRA alignment of 4 slots: the rule
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", str(configs._CONFIG_DIR / "h200.json"))
    assert configs.moe_block_m(8192, 8, 128, op=base) == 64  # not measured on the H200: the rule


def test_the_fp8_gemm_takes_its_own_entries_and_the_bf16_gemms_where_it_has_none(monkeypatch, tmp_path):
    """``fp8_moe_gemm`` entries (``sweep_configs.py --ops fp8_moe_gemm``) give the w8a8 GEMM its tiles and
    its alignment's ``BLOCK_M``; where none matches it takes ``fused_moe_gemm``'s tiles and the rule's
    block, never the bf16 alignment's ``BLOCK_M`` (measured with other tiles)."""
    import json

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    table = {"fused_moe_gemm": [{"max_rows": 64, "BLOCK_N": 32, "num_warps": 2}, {"BLOCK_N": 128, "num_warps": 8}],
             "moe_align_block_size": [{"max_rows": 64, "BLOCK_M": 16}, {"BLOCK_M": 128}],
             "fp8_moe_gemm": [{"max_rows": 256}, {"max_rows": 4096, "BLOCK_M": 64, "BLOCK_N": 256, "num_stages": 4}]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", str(path))
    own = configs.kernel_config("fp8_moe_gemm", rows=512, N=1536, K=2048, fallback_op="fused_moe_gemm")
    assert (own["BLOCK_N"], own["num_stages"], own["num_warps"]) == (256, 4, 8)  # warps: the bf16 GEMM's
    small = configs.kernel_config("fp8_moe_gemm", rows=64, N=1536, K=2048, fallback_op="fused_moe_gemm")
    assert (small["BLOCK_N"], small["num_warps"]) == (32, 2)  # an empty entry: the bf16 GEMM's tiles
    assert configs.moe_block_m(8, 8, 128, op="fp8_moe_gemm") == configs.moe_block_m(8, 8, 128) == 16  # the rule
    bf16 = configs.kernel_config("fp8_moe_gemm", rows=8192, N=1536, K=2048, fallback_op="fused_moe_gemm")
    assert (bf16["BLOCK_N"], bf16["num_warps"]) == (128, 8)
    assert configs.kernel_config("fp8_moe_gemm", rows=8192)["BLOCK_N"] == configs.GPU_FALLBACK_CONFIG["BLOCK_N"]
    assert configs.moe_block_m(64, 8, 128, op="fp8_moe_gemm") == 64  # 512 rows: its own entry
    assert configs.moe_block_m(1024, 8, 128, op="fp8_moe_gemm") == configs.moe_block_m(1024, 8, 128) == 64  # rule
    assert configs.moe_block_m(1024, 8, 128, op="moe_align_block_size") == 128
    # fused_moe's choice, one function: each base GEMM's own entries
    assert configs.base_moe_block_m(64, 8, 128, fp8=True) == 64 and configs.base_moe_block_m(1024, 8, 128) == 128
