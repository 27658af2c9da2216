"""The CPU-runnable parts of ``benchmarks/bench_engine.py`` (the H200 runs the real shape).

- ``test_tiny_benchmark_runs_every_regime_on_the_emulator``: the model and its peft adapters built at
  the ``tiny`` shape, read back by the engine's readers (ranks 16 and 64, four slots pinned), and the
  measurement loop over every regime and mode on the CPU graph emulator under the host-sync guard:
  one row per regime × adapters × mode, each measured forward checked to have run in its mode, the
  JSON record complete (with each runner's backend count and graph-buffer bytes).
- ``test_a_host_sync_in_a_measured_forward_is_recorded``: a host read slipped into the LM head fails
  the guard in every measured forward; each row records it, the case is measured without the guard,
  and the other cases still run (one GPU call reports every case).
- ``test_a_silent_fallback_fails_the_measurement``: a measured forward that ran another mode (an eager
  fallback) raises instead of being timed as a graph.
- ``test_verdicts``: the issue's targets computed from medians (speedups and the LoRA ratio).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from moelora_core.checkpoint import read_checkpoint

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks" / "bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.cudagraph
def test_tiny_benchmark_runs_every_regime_on_the_emulator(bench, tmp_path):
    pytest.importorskip("peft")
    record = bench.run(shape="tiny", device=torch.device("cpu"), backend="reference", workdir=tmp_path, runs=2,
                       warmup=1)
    weights = read_checkpoint(tmp_path / "model")
    shape = bench.MODELS["tiny"]
    assert (weights.config.hidden_size, weights.config.num_layers, weights.config.num_experts) == \
        (shape.hidden, shape.layers, shape.experts)
    for r in bench.RANKS:
        config = json.loads((tmp_path / f"r{r}" / "adapter_config.json").read_text())
        assert config["r"] == r and sorted(config["target_parameters"]) == ["mlp.experts.down_proj",
                                                                            "mlp.experts.gate_up_proj"]
    regimes = bench.REGIMES["tiny"]
    want = {(f"decode-bs{bs}", a, m) for bs in regimes["decode_bs"] for a in ("lora", "base")
            for m in ("eager", "decode_graph")}
    want |= {(f"prefill-{n}x{length}", "lora", m) for n, length in regimes["prefill"]
             for m in ("eager", "full", "breakable")}
    assert {(c["regime"], c["adapters"], c["mode"]) for c in record["cases"]} == want
    assert all(c["median_us"] > 0 and c["p10_us"] <= c["median_us"] <= c["p90_us"] and c["host_syncs"] == 0
               and c["runs"] == 2 for c in record["cases"])
    assert set(record["capture_s"]) == {"decode"} | {f"prefill-{n}x{length}-{m}" for n, length in regimes["prefill"]
                                                     for m in ("full", "breakable")}
    assert record["errors"] == []
    memory = record["memory"]
    assert memory["adapter_pool_bytes"] > 0 and set(memory["runners"]) == set(record["capture_s"])
    for name, row in memory["runners"].items():  # one backend per runner, its graph buffers counted
        assert row["backend_instances"] == 1 and row["graph_buffer_bytes"] > 0, (name, row)
        assert row["allocated_bytes"] is None  # CUDA's allocator only
    json.dumps(record)  # the record is JSON


def test_a_host_sync_in_a_measured_forward_is_recorded(bench, tmp_path, monkeypatch):
    """A forward that syncs under the guard is a finding in its row (and ``errors``); the case is then
    measured without the guard, and the other cases still run."""
    dirs = bench.build_checkpoint(bench.MODELS["tiny"], tmp_path, device=torch.device("cpu"))
    b = bench.Bench(dirs["model"], dirs, backend="reference", device=torch.device("cpu"), runs=2, warmup=0, seed=0)
    logits = b.engine.model.logits

    def leaky(h, fb):
        fb.logits_indices.sum().item()
        return logits(h, fb)

    monkeypatch.setattr(b.engine.model, "logits", leaky)
    b.decode((1,), 4)
    assert [c["mode"] for c in b.cases] == ["eager", "decode_graph"] * 2
    assert all(c["host_syncs"].startswith("HostSyncError") and c["median_us"] > 0 for c in b.cases)
    assert len(b.errors) == 4


def test_a_silent_fallback_fails_the_measurement(bench):
    log = bench.PassLog()
    log("decode", "decode_graph", "")
    log.check("decode_graph", since=0)
    log("decode", "eager", "over_requests")
    with pytest.raises(RuntimeError, match="ran 'eager' \\('over_requests'\\), expected 'decode_graph'"):
        log.check("decode_graph", since=0)
    log.check("eager", since=1)  # the eager pass alone, checked as eager


def test_verdicts(bench):
    rows = [dict(regime="decode-bs1", adapters="lora", mode="eager", median_us=900.0),
            dict(regime="decode-bs1", adapters="lora", mode="decode_graph", median_us=250.0),
            dict(regime="prefill-1x128", adapters="lora", mode="eager", median_us=1300.0),
            dict(regime="prefill-1x128", adapters="lora", mode="full", median_us=1000.0),
            dict(regime="prefill-1x128", adapters="lora", mode="breakable", median_us=1100.0),
            dict(regime="decode-bs256", adapters="lora", mode="decode_graph", median_us=1400.0),
            dict(regime="decode-bs256", adapters="base", mode="decode_graph", median_us=1000.0)]
    got = {v["target"]: (round(v["value"], 3), v["met"]) for v in bench.verdicts(rows)}
    assert got == {"decode graph >= 3x eager at bs 1 (with adapters)": (3.6, True),
                   "prefill full >= 1.3x eager at 1 x 128": (1.3, True),
                   "prefill breakable >= 1.3x eager at 1 x 128": (1.182, False),
                   "LoRA decode step <= 1.3x base-only at bs 256 (decode graph)": (1.4, False)}
