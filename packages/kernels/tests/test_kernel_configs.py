"""The shipped block-config table (``configs/h200.json``) as data: every key of every entry is one
the lookup reads (``kernel_config`` drops unknown keys, so a misspelt ``ALIGN_SPLT`` pasted from a
sweep would silently select the default), and the variant keys hold values their launchers accept."""

import pytest

from moelora_kernels import configs
from moelora_kernels.align import MAX_ALIGN_SPLIT
from moelora_kernels.moe_lora import MAX_SPLIT_K

SHAPE_KEYS = {"N", "K", "R", "max_rows"}


def _entries():
    table = configs._load_table(str(configs._CONFIG_DIR / "h200.json"))
    return [(op, e) for op, entries in table.items() for e in entries]


@pytest.mark.parametrize("op, entry", _entries(), ids=lambda v: v if isinstance(v, str) else "")
def test_shipped_entries_use_only_known_keys_and_valid_values(op, entry):
    unknown = set(entry) - SHAPE_KEYS - set(configs.GPU_FALLBACK_CONFIG)
    assert not unknown, f"{op} entry {entry}: keys the lookup ignores: {sorted(unknown)}"
    for key, v in entry.items():  # FUSED is a 0/1 flag, every other value a positive int
        assert isinstance(v, int) and v >= (0 if key == "FUSED" else 1), f"{op} entry {entry}: {key}={v!r}"
    if "SPLIT_K" in entry:
        assert op == "moe_lora_shrink" and 1 <= entry["SPLIT_K"] <= MAX_SPLIT_K, f"{op} entry {entry}"
    if "ALIGN_SPLIT" in entry:
        split = entry["ALIGN_SPLIT"]
        assert op in ("moe_lora_align_block_size", "moe_align_block_size"), f"{op} entry {entry}"
        assert 1 <= split <= MAX_ALIGN_SPLIT and not split & (split - 1), f"{op} entry {entry}"
