"""``benchmarks/bench_peers.py`` runs on the CPU (``--smoke``: interpreter, tiny fp16 shape): every
unit is checked against the benchmark's fp32 torch path before it is timed, and a row per path lands
in the JSON. Covers moelora's product path and one peer path (the others run in the GPU matrix), and
the base fused MoE rows: moelora's and SGLang's ``fused_moe_triton`` checked and timed with the
config each loaded, vLLM's recorded as skipped where it does not import.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_peers.py"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (the CPU)")
def test_smoke_checks_and_records_each_path(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("bench_peers", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "peers.json"
    assert mod.main(["--smoke", "--out", str(out), "--paths", "sglang:grouped"]) == 0
    rows = json.loads(out.read_text())["rows"]
    lora = [r for r in rows if r["unit"] == "lora"]
    assert [r["path"] for r in lora] == ["moelora", "sglang:grouped"]
    for r in lora:
        assert r["err"] < 5e-2 and r["b_us"] > 0 and r["c_us"] > 0 and r["config"]
    assert lora[1]["b_over_moelora"] > 0
    base = {r["path"]: r for r in rows if r["unit"] == "base"}
    assert list(base) == ["moelora", "sglang:fused_moe_triton", "vllm:fused_moe"]
    for name in ("moelora", "sglang:fused_moe_triton"):
        r = base[name]
        assert r["err"] < 5e-2 and r["a_us"] > 0 and r["config"], r
    assert base["moelora"]["c_us"] > 0
    # SGLang's base alignment is timed only where sgl_kernel runs it (its torch fallback syncs the host)
    assert "c_us" not in base["sglang:fused_moe_triton"] and base["sglang:fused_moe_triton"]["c_skipped"]
    assert base["moelora"]["config"].startswith("interpreter config")
    assert base["sglang:fused_moe_triton"]["config"] == "default config"  # no tuned table names a CPU
    assert base["sglang:fused_moe_triton"]["a_over_moelora"] > 0
    assert "error" not in base["vllm:fused_moe"] and base["vllm:fused_moe"]["skipped"]
