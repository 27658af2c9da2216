"""``benchmarks/bench_peers.py`` runs on the CPU (``--smoke``: interpreter, tiny fp16 shape): every
unit is checked against the benchmark's fp32 torch path before it is timed, and a row per path lands
in the JSON. Covers moelora's product path and one peer path (the others run in the GPU matrix).
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
    assert [r["path"] for r in rows] == ["moelora", "sglang:grouped"]
    for r in rows:
        assert r["err"] < 5e-2 and r["b_us"] > 0 and r["c_us"] > 0 and r["config"]
    assert rows[1]["b_over_moelora"] > 0
