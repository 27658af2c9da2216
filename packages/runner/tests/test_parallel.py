"""Tensor and expert parallelism on the CPU: two gloo processes (DESIGN.md §6, moelora_runner.parallel).

- ``test_parallel_outputs_equal_tp1``: TP = 2, EP = 2 and TP = 2 + EP = 2 serve the mixed workload of
  :mod:`parallel_support` (three adapters of ranks below the pool's R, base requests, evictions after
  capture, chunked prefill mixed with decodes) with the tokens and logprobs of the same run at TP = 1
  (``tp_vs_tp1`` row), eagerly and on the prefill graph (``full``, ``breakable``) with the decode graph,
  the metrics proving every pass ran on a graph; every backend (reference in every layout × mode;
  triton and csgmv CI-sized in the interpret profile: triton at tp2+ep2 on `full`, csgmv at tp2 eagerly; every one in the dev profile); OLMoE (its q/k norm
  over all heads sums squares over the ranks) and Mixtral.
- ``test_every_rank_samples_the_same_tokens``: both ranks' outputs are bitwise equal (the SPMD
  contract: every rank schedules and samples alike, or the collectives would deadlock).
- ``test_rank_below_pool_rank_gathers_to_the_tp1_pool``: the interleaved-zeros fault of vLLM's fully
  sharded MoE LoRA (shrink outputs gathered with zeros between the ranks' shards when r < R): every
  rank's pool, gathered along its sharded dimension, is the TP = 1 pool bit for bit, padding included;
  row-parallel shrinks summed over the ranks are the TP = 1 shrink with zeros only past r. The
  rank-splitting loader (``parallel_support.faulty_shard_module``) fails it, and
  ``test_the_faulty_rank_split_loader_is_caught`` shows the TP-vs-TP1 check catching it end to end.
- ``test_the_emulator_replays_the_collective``: a captured region with the engine's all-reduce replays
  the gloo collective on new inputs; a bare ``dist.all_reduce`` would not (the reason for the op).
- ``test_bad_parallel_sizes_are_refused_with_the_numbers``: sizes that do not divide heads / kv heads
  / I / experts, unsupported combinations, no process group: refused at start-up, by name.
- ``test_cli_tp2_spawns_workers_and_rank0_writes``: ``moelora generate --tp 2`` spawns its workers,
  rank 0 writes the output (equal to the TP = 1 command's within ``tp_vs_tp1``) and the metrics.

Cost: one spawn of two workers for every case (~10 s of start-up, then the cases), one more for the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import pickle

import graph_support as gs
import parallel_support as ps
import pytest
import runner_support as rs
import torch

from moelora_conformance.profiles import current_profile
from moelora_core.checkpoint import read_adapter, read_model_config
from moelora_core.checkpoint.slot_loader import load_adapter_into_slot
from moelora_core.weights import LoRAWeights
from moelora_runner import Engine, EngineConfigError
from moelora_runner.cli import main
from moelora_runner.parallel.launch import spawn
from moelora_runner.parallel.layout import ParallelLayout
from moelora_runner.parallel.sharding import local_layer_spec, shard_adapter

pytestmark = [pytest.mark.skipif(rs.DEVICE != "cpu", reason="gloo on the CPU; ci/gpu/run_tp.sh runs NCCL"),
              pytest.mark.xdist_group("parallel")]

LAYOUTS = ((2, 1), (1, 2), (2, 2))
_FULL = current_profile().name != "interpret"
CASES = [ps.Case("qwen3_moe", "reference", tp, ep, mode) for tp, ep in LAYOUTS
         for mode in ("eager", "full", "breakable")]
CASES += [ps.Case("olmoe", "reference", 2, 1, "breakable"), ps.Case("mixtral", "reference", 2, 2, "full")]
# CI-sized: each kernel backend in one layout x mode under the interpreter (every one beyond it).
CASES += [ps.Case("qwen3_moe", b, tp, ep, mode) for b in ("triton", "csgmv") for tp, ep in LAYOUTS
          for mode in ("eager", "full", "breakable")
          if _FULL or (b, tp, ep, mode) in {("triton", 2, 2, "full"), ("csgmv", 2, 1, "eager")}]
# Beyond the interpret profile: every fixture family in every layout its dims allow (reference, eager).
CASES += [ps.Case(m, "reference", tp, ep, "eager") for m in ps.other_models() for tp, ep in LAYOUTS
          if _FULL and ps.fits(m, tp, ep)]
FAULTY = ps.Case("qwen3_moe", "reference", 2, 1, "eager", faulty_sharding=True)


@pytest.fixture(scope="session")
def parallel_runs(tmp_path_factory, fixture_set, engine_adapters):
    """Both ranks' results of every case: one spawn of two gloo workers per test session, shared by the
    xdist workers through a build-once directory (a second xdist worker that gets some of these tests
    waits for the first one's results instead of spawning again)."""
    from moelora_conformance.fixtures.cache import shared_directory

    def build(directory):
        runs = spawn(ps.worker, 2, [*CASES, FAULTY], fixture_set.root / "models", engine_adapters, timeout_s=300)
        directory.mkdir(parents=True)
        (directory / "runs.pkl").write_bytes(pickle.dumps(runs))
        (directory / "done").write_text("ok\n")

    return pickle.loads((shared_directory(tmp_path_factory, "moelora-parallel-runs", build, marker="done")
                         / "runs.pkl").read_bytes())


_SINGLE: dict = {}


def _single(case, fixture_set, engine_adapters):
    key = case.single().id
    if key not in _SINGLE:
        _SINGLE[key] = ps.run_case(case.single(), fixture_set.root / "models", engine_adapters)
    return _SINGLE[key]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parallel_outputs_equal_tp1(case, parallel_runs, fixture_set, engine_adapters):
    got = parallel_runs[0][case.id]
    want = _single(case, fixture_set, engine_adapters)
    gs.compare_outputs(got["outputs"], want["outputs"], what=case.id, comparison="tp_vs_tp1",
                       record={"case": case.id, "seconds": got["seconds"]})
    if case.mode != "eager":
        gs.assert_ran_on_graphs(got["passes"], case.mode)
    assert got["passes"] == want["passes"]  # the same steps, in the same modes, as at TP = 1


def test_every_rank_samples_the_same_tokens(parallel_runs):
    rank0, rank1 = parallel_runs
    for case in CASES:
        for a, b in zip(rank0[case.id]["outputs"], rank1[case.id]["outputs"], strict=True):
            assert (a.output_token_ids, a.output_logprobs, a.prompt_logprobs) == \
                (b.output_token_ids, b.output_logprobs, b.prompt_logprobs), (case.id, a.request_id)


# --- rank padding under sharding ------------------------------------------------------------------------

#: For each module under TP: (factor, dim of the [L, (E,) ...] pool tensor it is split along), or None for
#: a replicated factor — written out here, independently of the sharder.
SPLIT = {"q": ("B", 1), "k": ("B", 1), "v": ("B", 1), "o": ("A", 2),
         "gate": ("B", 2), "up": ("B", 2), "down": ("A", 3)}


def _pools(config, adapter, layout, R=rs.POOL_RANK):
    spec = local_layer_spec(config, layout, max_loras=2, max_rank=R, dtype=torch.float32, device=torch.device("cpu"))
    pools = [LoRAWeights(spec) for _ in range(config.num_layers)]
    load_adapter_into_slot(pools, 1, shard_adapter(adapter, config, layout))
    return pools


def _gather_mismatches(config, adapter, tp):
    """Modules whose ranks' pools, gathered along the split dim (replicated factors: equal on every rank),
    differ from the TP = 1 pool bit for bit."""
    whole = _pools(config, adapter, ParallelLayout.single())
    ranks = [_pools(config, adapter, ParallelLayout(tp, 1, r)) for r in range(tp)]
    bad = []
    for layer in range(config.num_layers):
        for module, (factor, dim) in SPLIT.items():
            which = 0 if factor == "A" else 1
            want = whole[layer].factors(module)
            shards = [p[layer].factors(module) for p in ranks]
            split = torch.cat([s[which] for s in shards], dim=dim)
            kept = [s[1 - which] for s in shards]
            if not torch.equal(split, want[which]) or not all(torch.equal(k, want[1 - which]) for k in kept):
                bad.append((layer, module))
    return bad


def test_rank_below_pool_rank_gathers_to_the_tp1_pool(fixture_set, engine_adapters, monkeypatch):
    model = "qwen3_moe"
    config = read_model_config(fixture_set.model_dir(model))
    for name, path in engine_adapters[model][:3]:  # ranks 8, 6 and 3 (gate_up 2 in the pattern one) < R = 16
        adapter = read_adapter(path, config, name=name, dtype=torch.float32, max_rank=rs.POOL_RANK)
        assert adapter.max_rank() < rs.POOL_RANK
        assert _gather_mismatches(config, adapter, 2) == [], name
    # Row-parallel shrinks: summed over the ranks (what the all-reduce does through the linear expand), the
    # TP = 1 shrink, with zeros only past the adapter's rank.
    name, path = engine_adapters[model][2]  # legacy per-expert r = 3, with o
    adapter = read_adapter(path, config, name=name, dtype=torch.float32, max_rank=rs.POOL_RANK)
    whole = _pools(config, adapter, ParallelLayout.single())[0]
    ranks = [_pools(config, adapter, ParallelLayout(2, 1, r))[0] for r in range(2)]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, config.num_attention_heads * config.head_dim, generator=gen)
    h = torch.randn(7, config.moe_intermediate_size, generator=gen)
    for module, inp in (("o", x), ("down", h)):
        A = whole.factors(module)[0][1]
        A = A[0] if module == "down" else A  # expert 0
        want = inp @ A.T
        parts = [p.factors(module)[0][1] for p in ranks]
        parts = [a[0] if module == "down" else a for a in parts]
        width = parts[0].shape[-1]
        got = sum(inp[:, j * width:(j + 1) * width] @ a.T for j, a in enumerate(parts))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        r = adapter.layers[0][module].rank
        assert torch.count_nonzero(got[:, r:]) == 0 and torch.count_nonzero(got[:, :r]) > 0, module
    # The rank-splitting loader interleaves zeros: caught here.
    monkeypatch.setattr("moelora_runner.parallel.sharding.shard_module", ps.faulty_shard_module)
    name, path = engine_adapters[model][0]
    adapter = read_adapter(path, config, name=name, dtype=torch.float32, max_rank=rs.POOL_RANK)
    assert {m for _, m in _gather_mismatches(config, adapter, 2)} == {"gate", "up"}


def test_the_faulty_rank_split_loader_is_caught(parallel_runs, fixture_set, engine_adapters):
    got = parallel_runs[0][FAULTY.id]
    want = _single(FAULTY, fixture_set, engine_adapters)
    with pytest.raises(AssertionError):
        gs.compare_outputs(got["outputs"], want["outputs"], what=FAULTY.id, comparison="tp_vs_tp1")


def test_the_emulator_replays_the_collective(parallel_runs):
    for rank in (0, 1):
        probe = parallel_runs[rank]["probe"]
        for step, replay in enumerate(probe["engine"]):
            # x on rank j is 10·step + j + 1: the sum over ranks of 2x, plus 1
            torch.testing.assert_close(replay, torch.full((4,), 2.0 * (20 * step + 3) + 1), rtol=0, atol=0)
        # a bare dist.all_reduce ran at capture only: the replay reads this rank's 2x + 1, unreduced
        assert not torch.equal(probe["bare"][0], torch.full((4,), 7.0))


# --- bad input ------------------------------------------------------------------------------------------

def test_bad_parallel_sizes_are_refused_with_the_numbers(fixture_set, capsys, tmp_path):
    qwen = fixture_set.model_dir("qwen3_moe")  # 4 heads, 2 kv heads, I 32, 6 experts, top_k 2
    for kwargs, match in (
        (dict(tp=3), "--tp 3 does not divide the model's 4 attention heads"),
        (dict(tp=4), "--tp 4 does not divide the model's 2 key/value heads"),
        (dict(ep=4), "--ep 4 does not divide the model's 6 experts"),
        (dict(ep=6), "--ep 6 leaves 1 experts per rank, fewer than the model's top_k 2"),
        (dict(tp=2, ep=4), "--ep 4 with --tp 2 is not supported"),
        (dict(tp=0), "tp: must be an int >= 1, got 0"),
        (dict(tp=2), "tp=2 ep=1 needs a torch.distributed group of 2 ranks"),
    ):
        with pytest.raises(EngineConfigError, match=match):
            Engine(qwen, tp=kwargs.get("tp", 1), ep=kwargs.get("ep", 1))
    odd_i = dataclasses.replace(read_model_config(qwen), moe_intermediate_size=21)
    with pytest.raises(EngineConfigError, match="--tp 2 does not divide the MoE intermediate size 21"):
        ParallelLayout(2, 1).check(odd_i)
    ParallelLayout(2, 2).check(odd_i)  # under EP the experts keep their whole I
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"prompt_token_ids": [3, 4]}) + "\n")
    argv = ["generate", "--model", str(qwen), "--requests", str(requests), "--output", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--tp", "3"]) == 2
    assert "does not divide the model's 4 attention heads" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_tp2_spawns_workers_and_rank0_writes(fixture_set, engine_adapters, tmp_path, capfd):
    model = "qwen3_moe"
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in ps.requests(model)[:4]))
    argv = ["generate", "--model", str(fixture_set.model_dir(model)), "--max-lora-rank", "16", "--no-progress",
            "--requests", str(requests),
            *[a for n, p in engine_adapters[model][:3] for a in ("--adapter", f"{n}={p}")]]
    assert main([*argv, "--output", str(tmp_path / "tp1.jsonl")]) == 0
    assert main([*argv, "--output", str(tmp_path / "tp2.jsonl"), "--tp", "2", "--ep", "2",
                 "--metrics-file", str(tmp_path / "m.prom")]) == 0
    err = capfd.readouterr().err  # the workers write to the inherited stderr
    assert "tp=2 ep=2 rank 0/2" in err and "rank 1/2" not in err  # rank 0 alone prints
    from moelora_runner.requests import RequestOutput

    def read(name):
        return [RequestOutput(**{k: v for k, v in json.loads(line).items() if k in RequestOutput.__dataclass_fields__})
                for line in (tmp_path / name).read_text().splitlines()]

    gs.compare_outputs(read("tp2.jsonl"), read("tp1.jsonl"), what="cli tp2 ep2", comparison="tp_vs_tp1")
    assert 'moelora_forward_passes_total{mode="eager",phase="prefill",reason="disabled"}' in \
        (tmp_path / "m.prom").read_text()
