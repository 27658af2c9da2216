"""``benchmarks/check_targets.py``: the kernel-speed issue's "done" as a command, on hand-made runs and the
shipped ``benchmarks/targets-h100.json``: absolute targets for a ``bench_moe_lora.py`` run, the ratio rule
inside a ``bench_peers.py`` run (a cell whose run lacks a peer path is not judged), the card checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ROOT / "benchmarks" / "targets-h100.json"
CARD = "NVIDIA H100 80GB HBM3"


def _module():
    spec = importlib.util.spec_from_file_location("check_targets", ROOT / "benchmarks" / "check_targets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(tmp_path, name, rows, gpu=CARD) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": gpu, "rows": rows}))
    return path


def test_the_shipped_targets_cover_the_kernel_speed_grid():
    t = json.loads(TARGETS.read_text())
    assert t["card"] == CARD and t["lora_ratio"] == 0.5 and t["base_ratio"] == 1.0
    assert set(t["lora_b_us"]) == {"1", "8", "32", "128", "512", "2048", "8192"}
    assert all(set(v) == {"16", "64"} and all(x > 0 for x in v.values()) for v in t["lora_b_us"].values())
    assert set(t["lora_b_us"]) <= set(t["base_a_us"])


def test_a_bench_moe_lora_run_is_held_to_the_absolute_targets(tmp_path, capsys):
    mod = _module()
    t = json.loads(TARGETS.read_text())
    ok = t["lora_b_us"]["1"]["16"]
    rows = [{"M": 1, "R": 16, "a_us": t["base_a_us"]["1"] - 1, "b_us": ok},
            {"M": 1, "R": 64, "a_us": t["base_a_us"]["1"] - 1, "b_us": t["lora_b_us"]["1"]["64"] * 0.9},
            {"M": 3, "R": 16, "a_us": 1e6, "b_us": 1e6}]  # no target: listed, not counted
    assert mod.main([str(TARGETS), str(_write(tmp_path, "good.json", rows))]) == 0
    assert "3 of 3 cells met (absolute targets)" in capsys.readouterr().out
    rows[1]["b_us"] = t["lora_b_us"]["1"]["64"] * 1.5
    assert mod.main([str(TARGETS), str(_write(tmp_path, "slow.json", rows))]) == 1
    assert "lora b M=1 R=64" in (out := capsys.readouterr().out) and "MISSED by 1.50x" in out


def test_a_bench_peers_run_is_judged_inside_itself_and_only_with_every_peer_path(tmp_path, capsys):
    mod = _module()
    t = json.loads(TARGETS.read_text())
    lora = [{"M": 32, "R": 16, "unit": "lora", "path": "moelora", "b_us": 40.0}]
    lora += [{"M": 32, "R": 16, "unit": "lora", "path": p, "b_us": 100.0} for p in t["lora_peer_paths"][1:]]
    lora.append({"M": 32, "R": 16, "unit": "lora", "path": t["lora_peer_paths"][0], "error": "CompilationError"})
    base = [{"M": 32, "R": None, "unit": "base", "path": "moelora", "a_us": 400.0},
            {"M": 32, "R": None, "unit": "base", "path": "sglang:fused_moe_triton", "a_us": 390.0}]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "peers.json", lora + base))]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 cells met (ratio rule" in out  # 40 <= 0.5 x 100 (the failed path sets no time)
    assert "run lacks vllm:fused_moe" in out  # the base cell is not judged without vLLM's row
    lora[0]["b_us"] = 60.0
    assert mod.main([str(TARGETS), str(_write(tmp_path, "peers2.json", lora + base))]) == 1


def test_a_run_of_another_card_or_with_nothing_to_judge_is_refused(tmp_path, capsys):
    mod = _module()
    rows = [{"M": 1, "R": 16, "a_us": 1.0, "b_us": 1.0}]
    assert mod.main([str(TARGETS), str(_write(tmp_path, "h200.json", rows, gpu="NVIDIA H200"))]) == 2
    assert "not on the targets' card" in capsys.readouterr().out
    assert mod.main([str(TARGETS), str(_write(tmp_path, "none.json", [{"M": 3, "R": 8, "b_us": 1.0}]))]) == 2
