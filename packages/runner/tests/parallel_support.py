"""Helpers of the TP / EP tests (test_parallel.py): the cases, the workload, and what each of the two
gloo workers runs.

One spawn of two workers serves every case (a process group costs ~10 s to start on the CPU: torch
imports in each fresh process); each worker runs the cases in order on its rank and returns, per case,
the request outputs, the forward passes counted by its engine and the seconds it took. The TP = 1
runs are made in the test process.

The workload: qwen3_moe (or the case's model) with its five engine adapters (ranks 3..8, below the
pool's R = 16; fused, rsLoRA, legacy per-expert, attention-only, rank/alpha pattern) and base requests,
two slots (adapters evicted and loaded after graph capture), a 12-token budget (chunked prefill mixed
with decodes), decodes padded into a 4-request bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import graph_support as gs
import runner_support as rs

from moelora_runner.parallel.sharding import shard_module as correct_shard_module


@dataclass(frozen=True)
class Case:
    """One engine run: ``backend`` on ``model`` at (tp, ep) in graph mode ``mode`` (graph_support.MODES)."""

    model: str
    backend: str
    tp: int
    ep: int
    mode: str
    #: run with the rank-splitting loader of vLLM's fully sharded MoE LoRA (the faulty variant)
    faulty_sharding: bool = False

    @property
    def id(self) -> str:
        faulty = "-faulty-sharding" if self.faulty_sharding else ""
        return f"{self.model}-{self.backend}-tp{self.tp}-ep{self.ep}-{self.mode}{faulty}"

    def single(self) -> Case:
        """The same run at TP = 1 (what it is compared against)."""
        return Case(self.model, self.backend, 1, 1, self.mode)


ENGINE = dict(max_loras=2, max_num_batched_tokens=12, kv_cache_tokens=256, decode_batch_buckets=(4,),
              max_lora_rank=rs.POOL_RANK, check_host_sync=True)


def other_models() -> list[str]:
    """The fixture families besides the ones the CI-sized cases use."""
    from moelora_conformance.fixtures.specs import MODELS

    return [m.name for m in MODELS if m.name not in ("qwen3_moe", "olmoe", "mixtral")]


def fits(model: str, tp: int, ep: int) -> bool:
    """Whether the fixture model's dims split at (tp, ep) (its spec, without reading a checkpoint)."""
    from moelora_conformance.fixtures.specs import model_spec

    m = model_spec(model)
    return (tp == 1 or (m.heads % tp == 0 and m.kv_heads % tp == 0 and (ep > 1 or m.inter % tp == 0))) and \
        (ep == 1 or (m.experts % ep == 0 and m.experts // ep >= m.top_k))


def requests(model: str) -> list[dict]:
    names = [f"{model}-{suffix}" for suffix, _ in rs.ENGINE_ADAPTERS]
    return rs.mixed_requests([*names[:3], None], 8, seed=7, prompt_len=(1, 12), max_new_tokens=3, logprobs=2)


def run_case(case: Case, models: Path, adapters: dict[str, list[tuple[str, Path]]], device: str = "cpu",
             dtype: str = "float32") -> dict:
    """Serve the workload of ``case``; {"outputs", "passes", "seconds"}."""
    from moelora_runner import Engine

    start = time.perf_counter()
    engine = Engine(models / case.model, backend=case.backend, dtype=dtype, device=device, tp=case.tp, ep=case.ep,
                    **ENGINE, **gs.MODES[case.mode])
    for name, path in adapters[case.model]:
        engine.load_adapter(name, path)
    outputs = engine.generate(requests(case.model))
    return {"outputs": outputs, "passes": gs.passes(engine), "seconds": time.perf_counter() - start}


def faulty_shard_module(module, lora, config, layout):
    """vLLM's fully sharded MoE LoRA loader before its fix: A's rank split into r / tp shards, each padded
    on its own, so the gathered shrink output has zeros interleaved in the rank axis (the faulty variant
    the tests must catch). Here rank j keeps rows [j·r/tp, (j+1)·r/tp) of every gate / up A; the rest
    follows the correct sharder."""
    import torch

    from moelora_core.weights import ModuleLoRA

    out = correct_shard_module(module, lora, config, layout)
    if module not in ("gate", "up") or layout.moe_tp == 1:
        return out
    r = lora.rank
    per = r // layout.moe_tp
    A = torch.zeros_like(out.lora_A)
    A[:, :per] = lora.lora_A[:, layout.rank * per:(layout.rank + 1) * per]
    return ModuleLoRA(A, out.lora_B, out.scaling)


def emulator_collective_probe(rank: int) -> dict:
    """A captured region with one all-reduce, replayed on new inputs, through the engine's collective and
    through a bare ``dist.all_reduce``: what each replay returns on this rank."""
    import torch
    import torch.distributed as dist

    from moelora_core.graphs import graph_pools
    from moelora_runner.parallel.comm import Collectives, register

    comm = Collectives(register("world", None), dist.get_world_size())
    pool = graph_pools(torch.device("cpu"))["decode"]
    x = torch.randn(4, generator=torch.Generator().manual_seed(rank))
    results = {}
    for name, reduce in (("engine", comm.all_reduce_), ("bare", dist.all_reduce)):
        def region(reduce=reduce):
            y = x * 2
            reduce(y)
            return y + 1
        graph = pool.capture(region, warmup=0)
        replays = []
        for step in range(2):
            x.copy_(torch.full((4,), float(10 * step + rank + 1)))
            replays.append(graph.replay().clone())
        results[name] = replays
    return results


def worker(rank: int, cases: list[Case], models: Path, adapters: dict) -> dict:
    """Everything one rank runs: the emulator probe, then every case (the faulty ones with the faulty
    sharder patched in)."""
    from unittest import mock

    out = {"probe": emulator_collective_probe(rank)}
    for case in cases:
        if case.faulty_sharding:
            with mock.patch("moelora_runner.parallel.sharding.shard_module", faulty_shard_module):
                out[case.id] = run_case(case, models, adapters)
        else:
            out[case.id] = run_case(case, models, adapters)
    return out
