"""``benchmarks/check_targets.py``: the kernel-speed issue's "done" as a command, on hand-made runs and the
shipped ``benchmarks/targets-h100.json``: a ``bench_moe_lora.py`` run against the absolute targets (every
cell of the grid in it and met; duplicates judged by the worst row), a ``bench_peers.py`` run by the ratio
rule inside itself (a cell whose run lacks a peer path is not judged, a failed moelora row is a miss), and
unusable input refused by name (another card, NaN or non-positive times, rows without an int M), never a
traceback or a pass."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ROOT / "benchmarks" / "targets-h100.json"
T = json.loads(TARGETS.read_text())
CARD = T["card"]


def _module():
    spec = importlib.util.spec_from_file_location("check_targets", ROOT / "benchmarks" / "check_targets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(tmp_path, name, rows, gpu=CARD) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": gpu, "rows": rows}))
    return path


def _moe_lora_rows(factor: float = 0.9) -> list[dict]:
    """A bench_moe_lora run over the whole grid, every time ``factor`` x its target."""
    return [{"M": int(M), "R": int(R), "a_us": factor * T["base_a_us"][M], "b_us": factor * b}
            for M, by_r in T["lora_b_us"].items() for R, b in by_r.items()]


def _peers_rows(moelora: float = 40.0, peer: float = 100.0, base: float = 400.0) -> list[dict]:
    rows = []
    for M, by_r in T["lora_b_us"].items():
        rows.append({"M": int(M), "R": None, "unit": "base", "path": "moelora", "a_us": base})
        rows += [{"M": int(M), "R": None, "unit": "base", "path": p, "a_us": base + 1} for p in T["base_peer_paths"]]
        for R in by_r:
            rows.append({"M": int(M), "R": int(R), "unit": "lora", "path": "moelora", "b_us": moelora})
            rows += [{"M": int(M), "R": int(R), "unit": "lora", "path": p, "b_us": peer} for p in T["lora_peer_paths"]]
    return rows


def test_the_shipped_targets_cover_the_kernel_speed_grid():
    assert T["lora_ratio"] == 0.5 and T["base_ratio"] == 1.0
    assert set(T["lora_b_us"]) == {"1", "8", "32", "128", "512", "2048", "8192"}
    assert all(set(v) == {"16", "64"} and all(x > 0 for x in v.values()) for v in T["lora_b_us"].values())
    assert set(T["lora_b_us"]) <= set(T["base_a_us"])


def test_a_bench_moe_lora_run_is_held_to_every_cell_of_the_grid(tmp_path, capsys):
    mod = _module()
    rows = _moe_lora_rows()
    assert mod.main([str(TARGETS), str(_write(tmp_path, "good.json", [*rows, {"M": 3, "R": 16, "b_us": 1e6}]))]) == 0
    assert "21 of 21 cells met (absolute targets" in capsys.readouterr().out  # M 3: no target, not counted
    slow = [dict(r, b_us=r["b_us"] / 0.9 * 1.5) if (r["M"], r["R"]) == (1, 64) else r for r in rows]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "slow.json", slow))]) == 1
    assert "lora b M=1 R=64" in (out := capsys.readouterr().out) and "MISSED by 1.50x" in out
    assert mod.main([str(TARGETS), str(_write(tmp_path, "part.json", rows[:1]))]) == 1  # one cell is not done
    assert "MISSED: not in the run" in capsys.readouterr().out
    # a duplicate row is judged by its worst time, whichever comes first (the base a of each R row as well)
    worse = [dict(rows[0], a_us=1e6)]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "dup.json", rows + worse))]) == 1
    assert mod.main([str(TARGETS), str(_write(tmp_path, "dup2.json", worse + rows))]) == 1


def test_a_target_below_the_adapters_weight_floor_is_named_unreachable_and_still_missed(tmp_path, capsys):
    mod = _module()
    gbps = 3000.0
    rows = []
    for r in _moe_lora_rows(1.2):
        target = T["lora_b_us"][str(r["M"])][str(r["R"])]
        # the floor 10 % above the target at M 32 R 64 and 10 % below it everywhere else
        floor_us = target * (1.1 if (r["M"], r["R"]) == (32, 64) else 0.9)
        rows.append(dict(r, b_weight_bytes=int(floor_us * gbps * 1e3)))
    path = tmp_path / "floor.json"
    path.write_text(json.dumps({"gpu": CARD, "copy_plain": {"GBps": gbps}, "rows": rows}))
    assert mod.main([str(TARGETS), str(path)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "lora b M=32 R=64" in x)
    assert "MISSED by 1.20x" in line and "below the adapters' weight floor" in line
    assert sum("weight floor" in x for x in out.splitlines() if "lora b" in x) == 1
    assert "1 cells' targets lie below the bytes of the adapters" in out
    # a run without the plain-copy bandwidth names no floor
    path.write_text(json.dumps({"gpu": CARD, "rows": rows}))
    assert mod.main([str(TARGETS), str(path)]) == 1 and "weight floor" not in capsys.readouterr().out


def test_a_bench_peers_run_is_judged_inside_itself_and_only_with_every_peer_path(tmp_path, capsys):
    mod = _module()
    rows = _peers_rows()
    assert mod.main([str(TARGETS), str(_write(tmp_path, "peers.json", rows))]) == 0  # 40 <= 0.5 x 100
    capsys.readouterr()
    failed_peer = [{k: v for k, v in r.items() if k != "b_us"} | {"error": "CompilationError"}
                   if r["path"] == T["lora_peer_paths"][0] else r for r in rows]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "failed-peer.json", failed_peer))]) == 0  # present, no time
    lacking = [r for r in rows if r["path"] != "vllm:fused_moe"]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "lacking.json", lacking))]) == 1
    assert "not judged (run lacks vllm:fused_moe)" in capsys.readouterr().out
    assert mod.main([str(TARGETS), str(_write(tmp_path, "slow.json", _peers_rows(moelora=60.0)))]) == 1
    # moelora's own failed row is a miss, never dropped; a duplicate is judged by its worst time
    broken = [{k: v for k, v in r.items() if k != "b_us"} | {"error": "boom"} if r["path"] == "moelora"
              and (r["M"], r["R"]) == (32, 16) else r for r in rows]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "broken.json", broken))]) == 1
    assert "moelora's row holds no time" in capsys.readouterr().out
    dup = [*rows, {"M": 32, "R": 16, "unit": "lora", "path": "moelora", "b_us": 90.0}]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "dup.json", list(reversed(dup))))]) == 1


@pytest.mark.parametrize("rows, gpu, says", [
    (_moe_lora_rows(), "NVIDIA H200", "not on the targets' card"),
    (_moe_lora_rows(), f"[{CARD}]", "not on the targets' card"),
    ([{"M": 3, "R": 8, "b_us": 1.0}], CARD, "no cell with a target"),
    ([{"M": 1, "R": 16, "b_us": float("nan")}], CARD, "not a finite positive time"),
    ([{"M": 1, "R": 16, "b_us": -1.0}], CARD, "not a finite positive time"),
    ([{"M": 1, "R": 16, "b_us": "1.0"}], CARD, "not a finite positive time"),
    ([{"M": 1.0, "R": 16, "b_us": 1.0}], CARD, "int M"),
    (["row"], CARD, "int M"),
    ([{"M": 1, "R": 16, "unit": "lora", "path": "vllm:fused", "b_us": None}], CARD, "not a finite positive time"),
], ids=["h200", "substring", "nothing", "nan", "negative", "string", "float-M", "not-a-dict", "null-peer"])
def test_unusable_input_exits_2_with_its_reason(rows, gpu, says, tmp_path, capsys):
    assert _module().main([str(TARGETS), str(_write(tmp_path, "run.json", rows, gpu=gpu))]) == 2
    out = capsys.readouterr().out
    assert says in out and "Traceback" not in out


def test_a_file_that_is_not_a_run_exits_2(tmp_path, capsys):
    mod = _module()
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{")
    for name in ("list.json", "bad.json", "missing.json"):
        assert mod.main([str(TARGETS), str(tmp_path / name)]) == 2
    assert capsys.readouterr().out.count("check_targets: ") == 3


def test_each_card_has_its_own_targets_file_and_the_bench_reads_the_one_of_its_card(tmp_path):
    """``bench_moe_lora.py``'s "b tgt" column comes from the targets file of the card it runs on: an H100 run
    once printed the H200's targets (hard-coded in the bench) beside its times."""
    mod = _module()
    path, h100 = mod.for_card("NVIDIA H100 80GB HBM3")
    assert path.name == "targets-h100.json" and h100 == T
    path, h200 = mod.for_card("NVIDIA H200")
    assert path.name == "targets-h200.json"
    assert mod.cell_targets(h200, 32, 64) == (265.3, 66.6) and mod.cell_targets(h100, 32, 64) == (398.1, 57.1)
    assert mod.cell_targets(h200, 3, 16) == (None, None) and mod.cell_targets(None, 32, 64) == (None, None)
    assert mod.for_card("NVIDIA H200 NVL") is None and mod.for_card("NVIDIA A100-SXM4-80GB") is None
    # every cell of the H200's grid has both times, so check_targets judges a whole run against it
    assert {M for M in h200["lora_b_us"]} == set(h200["base_a_us"]) and all(
        set(by_r) == {"16", "64"} for by_r in h200["lora_b_us"].values())
    (tmp_path / "targets-x.json").write_text(json.dumps({"card": "X"}))
    with pytest.raises(ValueError, match=r"targets-x\.json: no 'lora_ratio'"):
        mod.for_card("X", tmp_path)
