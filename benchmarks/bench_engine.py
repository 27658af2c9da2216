"""Engine benchmark: eager forwards vs the graph runners (decode graph; prefill ``full`` and
``breakable``) on a Qwen3-30B-A3B-shaped model cut to 4 decoder layers, with real PEFT adapters.

Model (``qwen3-30b-a3b-4layer``): H 2048, MoE intermediate 768, E 128, top-8, 32 query / 4 KV heads,
head_dim 128, vocab 151936, bf16, random weights from a fixed seed (linear and expert weights
~ N(0, 1/in), router at twice that scale, norms 1 + N(0, 0.1²), as the fixtures draw them) made on the
device in one step and written as a fused-experts safetensors checkpoint; adapters of rank 16 and 64
(α = 2r, experts gate_up / down and q / k / v / o) made with peft (``get_peft_model`` with
``target_parameters``, seeded factors, ``save_pretrained`` in bf16), each registered under two names
so four slots hold adapters.

Regimes (synthetic steps written straight into the runner's ``StepPlan``, KV reserved through the
engine's ``KVCache``; the engine context of a regime is its own sequence length, so eager and graph
attention read the same key width):

- ``decode-bs{N}`` (N = 1, 8, 64, 256): one decode token per request at context 256, with adapters
  (slots 0-3 and base, cycling: 80 % adapter rows) and without (every request base);
- ``prefill-{n}x{L}`` (1 × 128, 1 × 512, 1 × 2048, 64 × 128): prompts from position 0, with adapters
  (one request: slot 0; 64 requests: cycling as above).

Each case is run ``--runs`` times after warm-up through ``ModelRunner.forward_logits`` (prepare,
staging, the forward or graph replay, the LM head on the sampling rows) with the host-sync guard on
(``set_sync_debug_mode("error")``: a host sync in a measured forward raises, so every measured forward
has zero), a CUDA event pair around each, synchronised after each; median, p10 and p90 in µs, and the
median host time to issue it (``host_us``: close to ``median_us`` means launch-bound). Every measured
forward is checked to have run in its mode (no silent eager fallback).

Each regime's runner is its own engine's: one backend instance, built for it and told of every
loaded slot, serves its eager passes and its graphs. Memory (the record's ``memory``): the adapter
pools' bytes (``adapter_pool_bytes``: every slot of every layer's ``LoRAWeights``) and, per runner, the backend
instances it holds, the bytes of its graph buffers (``graph_buffer_bytes``: the backends' static
metadata buffers and the static forward batches, distinct storages) and the device memory its
construction and capture took (``allocated_bytes`` / ``reserved_bytes``: ``torch.cuda`` deltas, the
graphs' private pools and any backend copy of the adapters included; None on a CPU). The same file
also measures the tree before one backend per engine (its ``ModelRunner`` takes ``make_backend``, one
backend per bucket), so a before/after pair runs one script.

    python benchmarks/bench_engine.py --out bench_engine.json        # ~5 min on an H200 (model build ~1-2)
    python benchmarks/bench_engine.py --decode-bs 1,64,256 --prefill 1x128,64x128 --reuse-checkpoint \
        --out after.json      # selected regimes; the checkpoint an earlier run built in --workdir

Tensor / expert parallel (``--tp N`` / ``--ep N``, under torchrun; NVLink multicast off): every rank holds
its slice of the model and adapters (``Engine(tp=, ep=)``), rank 0 builds the checkpoint and writes the
record; the decode-step regime of the multi-GPU issue:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 benchmarks/bench_engine.py --tp 2 --decode-bs 1,64,256 --no-prefill \
        --out bench_engine_tp2.json

Targets (issue): decode graph >= 3x eager at bs 1; full and breakable >= 1.3x eager at 1 x 128; the
LoRA decode step (4 adapters + base) <= 1.3x the base-only step at bs 256. On a CPU (tests) the same
code runs a tiny shape on the graph emulator with wall-clock timing (``--shape tiny --device cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for src in ("packages/core/src", "packages/kernels/src", "packages/backends/src", "packages/runner/src",
            "reference/src", "conformance/src"):
    if str(ROOT / src) not in sys.path:
        sys.path.insert(0, str(ROOT / src))

from moelora_core.batch import BatchSpec, Request  # noqa: E402
from moelora_core.forward_mode import ForwardMode  # noqa: E402
from moelora_core.sentinels import NO_ADAPTER  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-MoE shape of the registry."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int


#: Named shapes: the benchmark's, and a tiny one for the CPU tests.
MODELS: dict[str, ModelShape] = {
    "qwen3-30b-a3b-4layer": ModelShape(2048, 768, 128, 8, 4, 32, 4, 128, 151936, 4096),
    "tiny": ModelShape(32, 16, 4, 2, 2, 4, 2, 8, 64, 64),
}
RANKS = (16, 64)
#: Regimes per shape: decode batch sizes and context, prefill (requests, tokens each).
REGIMES: dict[str, dict] = {
    "qwen3-30b-a3b-4layer": dict(decode_bs=(1, 8, 64, 256), decode_context=256,
                                 prefill=((1, 128), (1, 512), (1, 2048), (64, 128))),
    "tiny": dict(decode_bs=(1, 3), decode_context=8, prefill=((1, 8), (3, 4))),
}
#: Adapter names over the two files: four slots.
ADAPTER_NAMES = ("r16a", "r16b", "r64a", "r64b")
#: Slot cycle of "with adapters": four adapters and base (80 % adapter rows).
MIXED_SLOTS = (0, 1, 2, 3, NO_ADAPTER)
TARGETS = {"decode_graph_speedup_bs1": 3.0, "prefill_speedup_1x128": 1.3, "lora_decode_ratio_bs256": 1.3}


# --- the model and its adapters -----------------------------------------------------------------


def hf_config(shape: ModelShape):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=2 * shape.inter,
                          moe_intermediate_size=shape.inter, num_hidden_layers=shape.layers,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                          num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=shape.max_positions,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                          rope_theta=1e6, rms_norm_eps=1e-6)


def _init_weights(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Every parameter from one generator on ``device`` (the fixtures' scales, drawn where the model lives:
    the CPU would take minutes for 3 B parameters)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise * (2.0 if name.endswith("mlp.gate.weight") else 1.0) / math.sqrt(p.shape[-1]))
            del noise


def build_checkpoint(shape: ModelShape, directory: Path, *, device: torch.device, seed: int = 0) -> dict[str, Path]:
    """Write the model (``directory/model``) and one peft adapter per rank (``directory/r{R}``).

    Returns:
        {"model": dir, 16: dir, 64: dir}.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from moelora_conformance.fixtures.adapters import lora_config, make_peft_model, save_peft
    from moelora_conformance.fixtures.specs import AdapterSpec

    out: dict = {"model": directory / "model"}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
    _init_weights(model, seed, device)
    model.eval()
    out["model"].mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out["model"])
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out["model"] / "model.safetensors"), metadata={"format": "pt"})
    del state
    for r in RANKS:
        spec = AdapterSpec(f"bench-r{r}", "bench", r=r, alpha=2 * r, seed=seed + r, stored_dtype="bfloat16")
        peft_model = make_peft_model(model, lora_config(spec), spec.seed)
        out[r] = directory / f"r{r}"
        save_peft(peft_model, out[r], base_name="bench", stored_dtype=spec.stored_dtype)
        model = peft_model.unload()
        del peft_model
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --- synthetic steps -----------------------------------------------------------------------------


def step_plan(adapters, kv, *, mode: ForwardMode, lengths: list[int], prefix: int, slots: list[int], vocab: int,
              gen: torch.Generator):
    """(plan, KV allocations): a :class:`~moelora_runner.model_runner.StepPlan` of requests computing
    ``lengths`` tokens each after ``prefix`` cached ones (KV reserved through ``kv``; the cached K/V is
    whatever the pool holds: finite), sampling the last row of each request."""
    from moelora_runner.forward_batch import ForwardBatchHost
    from moelora_runner.model_runner import StepPlan

    ids, pos, locs, rows, rpi, seq, logits_rows, requests, allocs = [], [], [], [], [], [], [], [], []
    for n, slot in zip(lengths, slots):
        alloc = kv.allocate(prefix + n)
        allocs.append(alloc)
        ids += torch.randint(2, vocab, (n,), generator=gen).tolist()
        pos += range(prefix, prefix + n)
        locs += alloc.locs[prefix:prefix + n]
        rows += [alloc.row] * n
        rpi.append(alloc.row)
        seq.append(prefix + n)
        logits_rows.append(len(ids) - 1)
        requests.append(Request(slot, n, prefix))
    spec = BatchSpec(mode, requests, adapters.max_loras, adapters.slot_ranks(), adapters.slot_scalings())
    host = ForwardBatchHost(spec, tuple(ids), tuple(pos), tuple(locs), tuple(rows), tuple(rpi), tuple(seq),
                            tuple(logits_rows))
    return StepPlan(None, host, ()), allocs


# --- timing ----------------------------------------------------------------------------------------


def measure(fn, *, runs: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median / p10 / p90 µs of ``fn()`` over ``runs`` calls after ``warmup`` (CUDA events on CUDA,
    synchronised after each call; wall clock elsewhere) and the median host µs to issue it."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times, host = [], []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) * 1e3)
        else:
            times.append(host[-1])
    times.sort()
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10],
            "p90_us": times[(9 * len(times)) // 10], "host_us": statistics.median(host), "runs": runs}


class PassLog:
    """The (phase, mode, reason) of every forward pass of a runner (the runner's ``on_pass``)."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, str, str]] = []

    def __call__(self, phase: str, mode: str, reason: str) -> None:
        self.passes.append((phase, mode, reason))

    def check(self, expected_mode: str, since: int) -> None:
        """Every pass after ``since`` ran in ``expected_mode`` (graph passes with reason "")."""
        for phase, mode, reason in self.passes[since:]:
            if mode != expected_mode or (mode != "eager" and reason):
                raise RuntimeError(f"a measured {phase} forward ran {mode!r} ({reason!r}), expected {expected_mode!r}")


# --- the benchmark -----------------------------------------------------------------------------------


class Bench:
    """The engine (model, adapters) and the runners of each regime (module doc)."""

    def __init__(self, model_dir: Path, adapter_dirs: dict, *, backend: str, device: torch.device, runs: int,
                 warmup: int, seed: int, tp: int = 1, ep: int = 1) -> None:
        from moelora_core.backend import load_backend
        from moelora_runner import Engine

        dtype = "bfloat16" if device.type == "cuda" else "float32"
        # The engine holds the model, the adapter pools and the eager backend; its own KV cache and
        # runner are not used (each regime gets its own KV and runners below).
        self.engine = Engine(model_dir, backend=backend, dtype=dtype, device=str(device), max_loras=4,
                             max_lora_rank=max(RANKS), kv_cache_tokens=16, max_num_seqs=1, graph="eager",
                             decode_graph=False, tp=tp, ep=ep)
        for name in ADAPTER_NAMES:
            self.engine.load_adapter(name, adapter_dirs[int(name[1:3])])
            self.engine.pin(name)
        factory = load_backend(backend)
        self.make_backend = lambda: factory(self.engine.backend.spec)
        self.device, self.runs, self.warmup = device, runs, warmup
        self.gen = torch.Generator().manual_seed(seed)
        self.cases: list[dict] = []
        self.capture_s: dict[str, float] = {}
        self.errors: list[str] = []
        adapters = self.engine.adapters
        self.memory: dict = {"adapter_pool_bytes": adapters.slot_bytes() * adapters.max_loras, "runners": {}}
        self._allocated_at: dict[int, tuple[int, int] | None] = {}

    def _kv(self, tokens: int, requests: int, context: int):
        from moelora_runner.kv_cache import KVCache

        c = self.engine.model.config
        return KVCache(num_layers=c.num_layers, num_kv_heads=self.engine.parallel.heads(c)[1], head_dim=c.head_dim,
                       num_tokens=tokens, max_requests=requests, max_context=context, dtype=self.engine.dtype,
                       device=self.device)

    def _runner(self, kv, graphs, log: PassLog):
        """A runner with a backend instance of its own (told of every loaded slot), as its own engine would
        have; ``make_backend`` too where the tree's ``ModelRunner`` builds one backend per bucket."""
        from moelora_core.backend import notify_slot_loaded
        from moelora_runner.model_runner import ModelRunner

        e = self.engine
        before = _device_memory(self.device)
        backend = self.make_backend()
        for slot in range(e.adapters.max_loras):
            for pool in e.adapters.pools:
                notify_slot_loaded(backend, slot, pool)
        kwargs = dict(check_host_sync=True, on_pass=log, graphs=graphs)
        if "make_backend" in inspect.signature(ModelRunner).parameters:  # the tree before one backend per engine
            kwargs["make_backend"] = self.make_backend
        runner = ModelRunner(e.model, backend, e.adapters, kv, self.device, **kwargs)
        self._allocated_at[id(runner)] = before
        return runner

    def _record_memory(self, name: str, runner) -> None:
        """The runner's backend instances, graph-buffer bytes and device-memory deltas (module doc)."""
        backends, buffers = graph_buffers(runner)
        row = {"backend_instances": len(backends), "graph_buffer_bytes": buffers, "allocated_bytes": None,
               "reserved_bytes": None}
        before, now = self._allocated_at.get(id(runner)), _device_memory(self.device)
        if before is not None and now is not None:
            row["allocated_bytes"], row["reserved_bytes"] = now[0] - before[0], now[1] - before[1]
        self.memory["runners"][name] = row
        mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"
        print(f"  memory {name:<24} {row['backend_instances']} backend(s), graph buffers "
              f"{mib(row['graph_buffer_bytes'])}, allocated {mib(row['allocated_bytes'])}, reserved "
              f"{mib(row['reserved_bytes'])}", flush=True)

    def _time(self, runner, log: PassLog, plan, mode: str, **labels) -> dict:
        """Measure one case; a failure is recorded in its row (and ``errors``), not raised, so one run
        reports every case. A host sync under the guard is a finding: the row says so and the case is
        measured again without the guard."""
        from moelora_core import HostSyncError

        row = {**labels, "mode": mode}
        since = len(log.passes)
        try:
            try:
                result = measure(lambda: runner.forward_logits(plan), runs=self.runs, warmup=self.warmup,
                                 device=self.device)
                row["host_syncs"] = 0
            except HostSyncError as exc:
                row["host_syncs"] = f"HostSyncError: {exc}"
                self.errors.append(f"{labels['regime']} {mode}: {row['host_syncs']}")
                runner.check_host_sync = False
                result = measure(lambda: runner.forward_logits(plan), runs=self.runs, warmup=self.warmup,
                                 device=self.device)
                runner.check_host_sync = True
            log.check(mode, since)
        except Exception as exc:  # recorded: the other cases still run
            row["error"] = f"{type(exc).__name__}: {exc}"
            self.errors.append(f"{labels['regime']} {mode}: {row['error']}")
            self.cases.append(row)
            print(f"  {labels['regime']:<18} {labels.get('adapters', ''):<5} {mode:<13} FAILED {row['error']}",
                  flush=True)
            return row
        row.update(result)
        self.cases.append(row)
        print(f"  {labels['regime']:<18} {labels.get('adapters', ''):<5} {mode:<13} median "
              f"{result['median_us']:10.1f} us  p10 {result['p10_us']:10.1f}  p90 {result['p90_us']:10.1f}  host "
              f"{result['host_us']:10.1f}", flush=True)
        return row

    def _capture(self, name: str, runner) -> bool:
        """Capture every bucket of ``runner`` (timed); a failure is recorded and the mode skipped."""
        t0 = time.perf_counter()
        try:
            runner.capture_all()
        except Exception as exc:  # recorded: the other modes still run
            self.errors.append(f"capture {name}: {type(exc).__name__}: {exc}")
            print(f"  capture {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
            return False
        self.capture_s[name] = time.perf_counter() - t0
        self._record_memory(name, runner)
        return True

    def decode(self, batch_sizes, context: int) -> None:
        from moelora_runner.graph_config import GraphConfig

        max_bs = max(batch_sizes)
        kv = self._kv(max_bs * context, max_bs, context)
        eager_log, graph_log = PassLog(), PassLog()
        eager = self._runner(kv, None, eager_log)
        graph = self._runner(kv, GraphConfig(decode_graph=True, decode_buckets=tuple(batch_sizes), capture="startup"),
                             graph_log)
        captured = self._capture("decode", graph)
        vocab = self.engine.model.config.vocab_size
        for bs in batch_sizes:
            for label, cycle in (("lora", MIXED_SLOTS), ("base", (NO_ADAPTER,))):
                slots = [cycle[i % len(cycle)] for i in range(bs)]
                plan, allocs = step_plan(self.engine.adapters, kv, mode=ForwardMode.DECODE, lengths=[1] * bs,
                                         prefix=context - 1, slots=slots, vocab=vocab, gen=self.gen)
                labels = dict(regime=f"decode-bs{bs}", phase="decode", bs=bs, tokens=bs, context=context,
                              adapters=label)
                self._time(eager, eager_log, plan, "eager", **labels)
                if captured:
                    self._time(graph, graph_log, plan, "decode_graph", **labels)
                for alloc in allocs:
                    kv.free(alloc)
        del graph, eager
        self._release()

    def prefill(self, cases) -> None:
        from moelora_runner.graph_config import GraphConfig

        vocab = self.engine.model.config.vocab_size
        for n, length in cases:
            tokens = n * length
            kv = self._kv(tokens + 1, n, length)
            logs = {m: PassLog() for m in ("eager", "full", "breakable")}
            runners = {"eager": self._runner(kv, None, logs["eager"])}
            for mode in ("full", "breakable"):
                config = GraphConfig(prefill=mode, max_num_requests=max(n, 1), prefill_buckets=(tokens,),
                                     capture="startup")
                runner = self._runner(kv, config, logs[mode])
                if self._capture(f"prefill-{n}x{length}-{mode}", runner):
                    runners[mode] = runner
            slots = [0] if n == 1 else [MIXED_SLOTS[i % len(MIXED_SLOTS)] for i in range(n)]
            plan, _ = step_plan(self.engine.adapters, kv, mode=ForwardMode.EXTEND, lengths=[length] * n, prefix=0,
                                slots=slots, vocab=vocab, gen=self.gen)
            for mode, runner in runners.items():
                self._time(runner, logs[mode], plan, mode, regime=f"prefill-{n}x{length}", phase="prefill", bs=n,
                           tokens=tokens, context=length, adapters="lora")
            del runners
            self._release()

    def _release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _device_memory(device: torch.device) -> tuple[int, int] | None:
    """(allocated, reserved) bytes on a CUDA device after a synchronisation; None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def graph_buffers(runner) -> tuple[set[int], int]:
    """(ids of the backend instances ``runner`` holds, bytes of its graph buffers: every backend's
    static metadata buffers of the graph families and every static forward batch, distinct storages).
    Reads both layouts: one backend and one buffer set per family, or one backend and one static batch
    per bucket (the tree before one backend per engine)."""
    backends = {id(runner.backend): runner.backend}
    storages: dict[int, int] = {}
    for graph in (runner.decode_graph, runner.prefill_graph):
        if graph is None:
            continue
        holders = [graph, *graph.buckets.values()]
        for holder in holders:
            backend = getattr(holder, "backend", None)
            if backend is not None:
                backends[id(backend)] = backend
        tensors = []
        for backend in {id(getattr(h, "backend", None)): getattr(h, "backend", None) for h in holders}.values():
            with contextlib.suppress(Exception):  # a family this backend never initialised
                tensors += list(backend.static_buffers(graph.family).values())
        for holder in holders:
            static = getattr(holder, "static", None)
            if static is not None:
                tensors += [b.tensor for b in static.buffers.values()]
        for t in tensors:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return set(backends), sum(storages.values())


def verdicts(cases: list[dict]) -> list[dict]:
    """The issue's targets against the measured medians (those whose regimes ran)."""

    def median(**match):
        rows = [c for c in cases if "median_us" in c and all(c.get(k) == v for k, v in match.items())]
        return rows[0]["median_us"] if rows else None

    def verdict(target: str, key: str, value: float, lower_is_better: bool = False) -> dict:
        bound = TARGETS[key]
        return dict(target=target, value=value, bound=bound, met=value <= bound if lower_is_better else value >= bound)

    out = []
    eager = median(regime="decode-bs1", adapters="lora", mode="eager")
    graph = median(regime="decode-bs1", adapters="lora", mode="decode_graph")
    if eager and graph:
        out.append(verdict("decode graph >= 3x eager at bs 1 (with adapters)", "decode_graph_speedup_bs1",
                           eager / graph))
    eager = median(regime="prefill-1x128", mode="eager")
    for mode in ("full", "breakable"):
        graph = median(regime="prefill-1x128", mode=mode)
        if eager and graph:
            out.append(verdict(f"prefill {mode} >= 1.3x eager at 1 x 128", "prefill_speedup_1x128", eager / graph))
    lora = median(regime="decode-bs256", adapters="lora", mode="decode_graph")
    base = median(regime="decode-bs256", adapters="base", mode="decode_graph")
    if lora and base:
        out.append(verdict("LoRA decode step <= 1.3x base-only at bs 256 (decode graph)", "lora_decode_ratio_bs256",
                           lora / base, lower_is_better=True))
    return out


def environment(device: torch.device, backend: str) -> dict:
    import transformers

    env = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(), "backend": backend,
           "device": str(device)}
    with contextlib.suppress(Exception):
        import peft
        import triton

        env.update(peft=peft.__version__, triton=triton.__version__)
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=str(torch.version.cuda))
    with contextlib.suppress(Exception):
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, check=True).stdout.strip()
    return env


def _built(workdir: Path) -> bool:
    """Whether ``workdir`` holds a complete ``build_checkpoint`` (the model and every adapter)."""
    return (workdir / "model" / "model.safetensors").exists() and all(
        (workdir / f"r{r}" / "adapter_config.json").exists() for r in RANKS)


def run(*, shape: str, device: torch.device, backend: str, workdir: Path, runs: int, warmup: int, seed: int = 0,
        tp: int = 1, ep: int = 1, reuse: bool = False, **regimes) -> dict:
    """Build the model and adapters under ``workdir`` (``reuse``: keep a complete build already there,
    made from the same seed by an earlier run), run every regime of the shape (``regimes`` overrides
    ``REGIMES[shape]``); the JSON record. With ``tp`` / ``ep`` above 1 (a process group running): rank 0
    builds, every rank then loads its slice and runs the same regimes."""
    regimes = {**REGIMES[shape], **regimes}
    t0 = time.perf_counter()
    parallel = max(tp, ep) > 1
    if parallel:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            dirs = build_checkpoint(MODELS[shape], workdir, device=device, seed=seed)
        dist.barrier()
        dirs = {"model": workdir / "model", **{r: workdir / f"r{r}" for r in RANKS}}  # build_checkpoint's layout
    elif reuse and _built(workdir):
        dirs = {"model": workdir / "model", **{r: workdir / f"r{r}" for r in RANKS}}
    else:
        dirs = build_checkpoint(MODELS[shape], workdir, device=device, seed=seed)
    build_s = time.perf_counter() - t0
    print(f"built {shape} and adapters r{'/'.join(map(str, RANKS))} in {build_s:.1f} s", flush=True)
    bench = Bench(dirs["model"], dirs, backend=backend, device=device, runs=runs, warmup=warmup, seed=seed, tp=tp,
                  ep=ep)
    load_s = time.perf_counter() - t0 - build_s
    bench.decode(regimes["decode_bs"], regimes["decode_context"])
    bench.prefill(regimes["prefill"])
    record = {"environment": {**environment(device, backend), "tp": tp, "ep": ep},
              "shape": {"name": shape, **asdict(MODELS[shape])},
              "ranks": list(RANKS), "adapters": list(ADAPTER_NAMES), "regimes": regimes, "runs": runs,
              "warmup": warmup,
              "model_bytes": bench.engine.model.bytes(), "build_s": build_s, "load_s": load_s,
              "capture_s": bench.capture_s, "memory": bench.memory, "cases": bench.cases,
              "verdicts": verdicts(bench.cases),
              "errors": bench.errors, "total_s": time.perf_counter() - t0}
    for v in record["verdicts"]:
        print(f"{'met ' if v['met'] else 'MISS'}  {v['target']}: {v['value']:.2f} (bound {v['bound']})", flush=True)
    for e in bench.errors:
        print(f"ERROR {e}", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON record")
    parser.add_argument("--shape", choices=sorted(MODELS), default="qwen3-30b-a3b-4layer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="triton", help="triton, csgmv, reference or module:factory")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moelora-bench-engine"))
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="decode bs 1 and 256, prefill 1 x 128, 10 runs")
    parser.add_argument("--decode-bs", default=None, metavar="1,64,256",
                        help="decode batch sizes (default: the shape's)")
    parser.add_argument("--no-prefill", action="store_true", help="decode regimes only")
    parser.add_argument("--prefill", default=None, metavar="1x128,64x128",
                        help="prefill regimes as REQUESTSxTOKENS (default: the shape's)")
    parser.add_argument("--reuse-checkpoint", action="store_true",
                        help="keep the model and adapters a previous run built in --workdir (same seed)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (under torchrun)")
    args = parser.parse_args(argv)
    regimes = REGIMES[args.shape]
    extra = dict(decode_bs=(regimes["decode_bs"][0], regimes["decode_bs"][-1]), prefill=regimes["prefill"][:1],
                 runs=10) if args.quick else dict(runs=args.runs)
    if args.decode_bs:
        extra["decode_bs"] = tuple(int(b) for b in args.decode_bs.split(","))
    if args.prefill:
        extra["prefill"] = tuple(tuple(int(v) for v in case.split("x")) for case in args.prefill.split(","))
    if args.no_prefill:
        extra["prefill"] = ()
    device = torch.device(args.device)
    rank = 0
    if max(args.tp, args.ep) > 1:
        from moelora_runner.parallel.comm import init_group
        from moelora_runner.parallel.launch import torchrun_rank, worker_device

        launched = torchrun_rank()
        if launched is None:
            print("--tp / --ep above 1 run under torchrun (torchrun --nproc-per-node N ...)", file=sys.stderr)
            return 2
        rank, world, local = launched
        device = worker_device(args.device, local)
        init_group(rank=rank, world=world, device=device)
    record = run(shape=args.shape, device=device, backend=args.backend, workdir=args.workdir,
                 warmup=args.warmup, tp=args.tp, ep=args.ep, reuse=args.reuse_checkpoint, **extra)
    if rank != 0:
        return 1 if record["errors"] else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out} ({record['total_s']:.0f} s, {len(record['errors'])} errors)")
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
