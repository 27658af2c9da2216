"""One backend on one model: the workload served in every engine mode, checked (E01-E05), and the
stateful engine properties (E06, ``moelora_conformance.e2e.stateful`` when it is installed).

:class:`E2EConfig` holds the engine settings of the run. The defaults are CI-sized (64 requests,
8 new tokens, 3 slots for 5 adapters) and set the graphs' capacity *below* the workload's peaks, so
one run has steps that fit a captured graph and steps beyond it (E03 / E04): prefill buckets up to 48
tokens and 8 request slots, decode buckets up to 8 requests. The step budget is the largest prefill
bucket (48 tokens), so every chunk the budget cuts fits a prefill graph: first, middle and last chunks
replay its buckets next to decodes (a budget past the largest bucket ran every cut chunk eagerly,
``over_tokens``); the steps beyond capacity are over the request slots.

Every record carries a rerun line (:func:`rerun_line`): the ``moelora-conformance e2e`` command that
reproduces its run — the inputs (``--model`` / ``--adapter`` as absolute paths, or the fixture family),
every setting of :class:`E2EConfig` as its option, the dtype and device, and the options the caller
adds (manifest, ``--no-hf``, ``--require-coverage``); the workload claims of one mode
(``--modes M --properties E01,...,E05``) or the state machine (``--properties E06``).

What each adapter changes is taken from the eager engine (``Engine.adapter_effect``): the no-op
adapters are named through ``warn`` at load, meet no E05 adapter item, and a claim that relied only on
them is ``not_meaningful`` (:func:`.checks.not_meaningful`).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moelora_conformance.e2e.checks import (
    Capacity,
    check_graph_paths,
    check_graph_vs_eager,
    check_hf,
    check_workload,
    not_meaningful,
)
from moelora_conformance.e2e.engine_checks import HFReference
from moelora_conformance.e2e.properties import E2E_PROPERTIES, STATEFUL
from moelora_conformance.e2e.results import DTYPE_NAMES, E2E_MODES, E2EResult
from moelora_conformance.e2e.workload import RELOADED, Served, make_workload, reloaded_weights, serve, write_reloaded

#: Engine arguments of each e2e mode (the graph modes run their decodes on the decode graph).
MODE_ARGS: dict[str, dict] = {
    "eager": dict(graph="eager", decode_graph=False),
    "decode_graph": dict(graph="eager", decode_graph=True),
    "full": dict(graph="full", decode_graph=True),
    "breakable": dict(graph="breakable", decode_graph=True),
}
#: The module that holds the state machine (E06).
STATEFUL_MODULE = "moelora_conformance.e2e.stateful"
#: The claims checked on the served workload (every mode); E06 is the state machine's.
WORKLOAD_PROPERTIES: tuple[str, ...] = tuple(p for p in E2E_PROPERTIES if p != STATEFUL)


@dataclass(frozen=True)
class E2EConfig:
    """Settings of one e2e run (module doc).

    Attributes:
        requests, max_new_tokens, seed, arrival_steps: the workload (:func:`~.workload.make_workload`;
            arrivals spread over ``arrival_steps``, default twice the requests: most steps then fit a
            captured bucket, and long prompts still fill the step budget).
        max_prompt_tokens: the longest prompt (None: the model's context minus ``max_new_tokens``).
        max_loras: adapter slots (None: one fewer than the adapters, so slots are evicted and reused).
        max_num_batched_tokens: the step's token budget (chunked prefill).
        prefill_token_buckets, max_num_requests, decode_batch_buckets: the captured capacity.
        kv_cache_tokens: KV locations. state_machine_examples: E06's Hypothesis examples (0: skip E06).
        modes: the engine modes whose records are reported (eager always runs: the graph modes' reference).
        properties: the claims to check (default all): without a workload claim (E01-E05) no workload is
            served; without E06 the state machine does not run.
    """

    requests: int = 64
    max_new_tokens: int = 8
    seed: int = 0
    arrival_steps: int | None = None
    max_prompt_tokens: int | None = None
    max_loras: int | None = None
    max_num_batched_tokens: int = 48
    prefill_token_buckets: tuple[int, ...] = (16, 32, 48)
    max_num_requests: int = 8
    decode_batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    kv_cache_tokens: int = 8192
    state_machine_examples: int = 20
    modes: tuple[str, ...] = field(default=E2E_MODES)
    properties: tuple[str, ...] = field(default=tuple(E2E_PROPERTIES))

    @property
    def capacity(self) -> Capacity:
        return Capacity(max(self.prefill_token_buckets), self.max_num_requests, max(self.decode_batch_buckets))

    def options(self) -> list[str]:
        """The ``moelora-conformance e2e`` options that set every field but ``modes`` and ``properties``."""
        out = ["--requests", str(self.requests), "--max-new-tokens", str(self.max_new_tokens), "--seed", str(self.seed)]
        for flag, value in (("--arrival-steps", self.arrival_steps), ("--max-prompt-tokens", self.max_prompt_tokens),
                            ("--max-loras", self.max_loras)):
            if value is not None:
                out += [flag, str(value)]
        return [*out, "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--prefill-token-buckets", ",".join(map(str, self.prefill_token_buckets)),
                "--max-num-requests", str(self.max_num_requests),
                "--decode-batch-buckets", ",".join(map(str, self.decode_batch_buckets)),
                "--kv-cache-tokens", str(self.kv_cache_tokens),
                "--state-machine-examples", str(self.state_machine_examples)]


def model_inputs(model_dir: Path, adapters: dict[str, Path]) -> list[str]:
    """``--model DIR --adapter NAME=DIR ...`` with absolute paths (a rerun line works from any directory)."""
    out = ["--model", str(Path(model_dir).resolve())]
    for name, path in sorted(adapters.items()):
        out += ["--adapter", f"{name}={Path(path).resolve()}"]
    return out


def rerun_line(backend: str, inputs: Sequence[str], config: E2EConfig, *, dtype: str, device: str,
               mode: str | None = None, extra: Sequence[str] = ()) -> str:
    """The command that reruns one record's run (module doc): the workload claims of engine mode
    ``mode``, or (``mode`` None) the state machine E06."""
    what = ["--modes", mode, "--properties", ",".join(WORKLOAD_PROPERTIES)] if mode else ["--properties", STATEFUL]
    argv = ["moelora-conformance", "e2e", "--backend", backend, *inputs, *what, *config.options(),
            "--dtype", dtype, "--device", device, *extra]
    return shlex.join(argv)


def adapter_kinds(adapters: dict[str, Path], model_config) -> dict[str, dict]:
    """name → {"rank", "rslora", "per_expert"} of each adapter as the checkpoint reader reads it for
    the model (the largest module rank, ``use_rslora``, legacy per-expert expert keys).

    Raises:
        the reader's refusals (``moelora_core.checkpoint.ADAPTER_REFUSALS``), naming the adapter.
    """
    from moelora_core.checkpoint import read_adapter

    out = {}
    for name, path in adapters.items():
        weights = read_adapter(Path(path), model_config, name=name)
        lora = weights.config.lora
        out[name] = dict(rank=weights.max_rank(), rslora=lora.use_rslora, per_expert="per_expert" in weights.formats,
                         pattern=layer_specific(lora.rank_pattern) and layer_specific(lora.alpha_pattern))
    return out


def layer_specific(pattern) -> bool:
    """Whether a rank_pattern / alpha_pattern has a key naming one layer (``layers.1.self_attn.q_proj``)."""
    return any(re.search(r"(^|\.)\d+\.", str(key)) for key in (pattern or {}))


def _make_engine(model_dir: Path, adapters: dict[str, Path], *, backend: str, mode: str, dtype: str, device: str,
                 config: E2EConfig, max_loras: int, rank: int):
    from moelora_core.checkpoint import AdapterWarning
    from moelora_runner import Engine

    engine = Engine(model_dir, backend=backend, dtype=dtype, device=device, max_loras=max_loras, max_lora_rank=rank,
                    max_num_batched_tokens=config.max_num_batched_tokens, kv_cache_tokens=config.kv_cache_tokens,
                    prefill_token_buckets=config.prefill_token_buckets, max_num_requests=config.max_num_requests,
                    decode_batch_buckets=config.decode_batch_buckets, check_host_sync=True, **MODE_ARGS[mode])
    with warnings.catch_warnings():  # named once, through run_model's ``warn``, not once per mode
        warnings.simplefilter("ignore", AdapterWarning)
        for name, path in adapters.items():
            engine.load_adapter(name, path)
    return engine


def run_model(backend: str, model_dir: Path, adapters: dict[str, Path], *, config: E2EConfig = E2EConfig(),
              dtype: str = "float32", device: str = "cpu", model_name: str | None = None,
              hf: bool = True, record_path: str | Path | None = None, progress=None,
              inputs: Sequence[str] | None = None, rerun_extra: Sequence[str] = (),
              warn: Callable[[str], None] | None = None) -> list[E2EResult]:
    """The e2e suite of ``backend`` on one model: every mode of ``config.modes`` (eager always runs
    first: it is the graph modes' reference), E01-E05, then E06.

    Args:
        backend: a built-in name or "module:factory". model_dir: an HF MoE checkpoint.
        adapters: name → PEFT adapter directory (at least two, so one slot fewer than adapters
            still serves one adapter).
        dtype: "float32" / "float16" / "bfloat16". device: "cpu" / "cuda".
        hf: compare against HF + PEFT (E02; needs transformers + peft).
        record_path: JSONL file for the graph-vs-eager measurements (the GPU tolerance rows).
        progress: called with each finished record.
        inputs: the rerun lines' input options (default :func:`model_inputs`; the fixture run passes
            ``--families F``). rerun_extra: options the rerun lines end with (the caller's manifest, ...).
        warn: called with each adapter warning at load (no-op adapters, config notes).

    Returns:
        One record per property × mode (failed ones say why; a mode whose engine could not be built or
        crashed fails every claim of that mode, named).
    """
    model_dir = Path(model_dir)
    name_ = model_name or model_dir.name
    dt = DTYPE_NAMES.get(dtype, dtype)
    notify = progress or (lambda r: None)
    from moelora_runner.model_info import ModelInfo

    info = ModelInfo.read(model_dir)
    kinds = adapter_kinds(adapters, info.config)
    rank = max(16, max(k["rank"] for k in kinds.values()))
    max_loras = config.max_loras or max(1, len(adapters) - 1)
    max_prompt = config.max_prompt_tokens or info.max_context - config.max_new_tokens
    workload = make_workload(sorted(adapters), vocab=info.config.vocab_size, max_prompt_tokens=max_prompt,
                             n=config.requests, max_new_tokens=config.max_new_tokens, seed=config.seed,
                             arrival_steps=config.arrival_steps or 2 * config.requests,
                             budget=config.max_num_batched_tokens)
    inputs = list(inputs) if inputs is not None else model_inputs(model_dir, adapters)
    # the same-config reload's new weights, and their PEFT directory for HF + PEFT (E02)
    scratch = Path(tempfile.mkdtemp(prefix="moelora-e2e-"))
    reload_weights, references = None, dict(adapters)
    if workload.reload is not None:
        name = workload.reload[1]
        reload_weights = reloaded_weights(adapters[name])
        write_reloaded(adapters[name], scratch / "reloaded")
        references[RELOADED.format(name)] = scratch / "reloaded"
    try:
        return _run_modes(backend, model_dir, adapters, config=config, dtype=dtype, device=device, name=name_,
                          hf=hf, record_path=record_path, notify=notify, inputs=inputs, rerun_extra=rerun_extra,
                          warn=warn, info=info, kinds=kinds, rank=rank, max_loras=max_loras, max_prompt=max_prompt,
                          workload=workload, reload_weights=reload_weights, references=references, dt=dt)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_modes(backend, model_dir, adapters, *, config, dtype, device, name, hf, record_path, notify, inputs,
               rerun_extra, warn, info, kinds, rank, max_loras, max_prompt, workload, reload_weights, references,
               dt) -> list[E2EResult]:
    from moelora_runner.errors import EngineConfigError

    def rerun(mode: str | None) -> str:
        return rerun_line(backend, inputs, config, dtype=dtype, device=device, mode=mode, extra=rerun_extra)

    selected = set(config.properties)
    results: list[E2EResult] = []
    noop: dict[str, str] = {}
    effects_known = False

    def adapter_effects(engine) -> None:
        nonlocal effects_known
        if effects_known:
            return
        effects_known = True
        for n in sorted(adapters):
            effect = engine.adapter_effect(n)
            if effect is None:  # an engine whose adapter pool did not measure it
                continue
            if effect.noop:
                noop[n] = effect.reason()
            for message in effect.warnings():
                (warn or (lambda m: None))(message)

    workload_modes = ("eager", *(m for m in config.modes if m != "eager")) if selected & set(WORKLOAD_PROPERTIES) \
        else ()
    reference, why_not = _hf_reference(model_dir, references, hf, dtype, device) if workload_modes else (None, "")
    eager: Served | None = None
    located: dict[tuple[str, str], str | None] = {}
    for mode in workload_modes:
        base = E2EResult("E00", backend, mode, dt, name, repro=rerun(mode))
        start = time.perf_counter()
        try:
            engine = _make_engine(model_dir, adapters, backend=backend, mode=mode, dtype=dtype, device=device,
                                  config=config, max_loras=max_loras, rank=rank)
            adapter_effects(engine)
            served = serve(engine, workload, reload_weights=reload_weights)
            served_s = time.perf_counter() - start
        except Exception as exc:  # the engine or the backend crashed: every claim of this mode failed, named
            props = ["E02", "E05"] if mode == "eager" else ["E01", "E02", "E03", "E04", "E05"]
            for p in (p for p in props if p in selected):
                rec = E2EResult(p, backend, mode, dt, name, repro=base.repro, duration=time.perf_counter() - start)
                if isinstance(exc, EngineConfigError):
                    # the backend does not declare this mode, dtype or device: not implemented, as in the layer suite
                    rec.outcome, rec.message = "not_implemented", f"not implemented: {exc}"
                else:
                    rec.failed(f"{type(exc).__name__}: {exc}")
                if mode in config.modes:
                    results.append(rec)
                    notify(rec)
            continue
        mode_records = [check_workload(base, served, workload, adapter_kinds=kinds, max_loras=max_loras,
                                       n=config.requests, max_prompt_tokens=max_prompt,
                                       family=info.config.model_type, noop=frozenset(noop), mode=mode)]
        mode_records[0].duration += served_s  # the engine run is the workload claim's (E05) time
        if mode == "eager":
            eager = served
        else:
            if eager is not None:
                mode_records.append(check_graph_vs_eager(base, served, eager, dtype=dtype, record_path=record_path,
                                                         base_quant=info.config.base_quant))
            else:
                mode_records.append(E2EResult("E01", backend, mode, dt, name).failed("the eager reference run failed"))
            mode_records += check_graph_paths(base, served, config.capacity, last_fallback=engine.runner.last_fallback)
        mode_records.append(check_hf(base, served, workload, reference, dtype=dtype, why_not=why_not))
        for rec in mode_records:  # a failure says where: the first step, layer and module that departs
            if rec.property in ("E01", "E02") and rec.outcome == "failed" and rec.property in selected:
                _locate(rec, located, workload=workload, served=served, reload_weights=reload_weights, dtype=dtype,
                        make=lambda which, mode=mode: _make_engine(
                            model_dir, adapters, backend=backend if which == "test" else "reference",
                            mode=mode if which == "test" else "eager", dtype=dtype, device=device, config=config,
                            max_loras=max_loras, rank=rank),
                        capacity=max(config.max_num_batched_tokens, *config.prefill_token_buckets,
                                     *config.decode_batch_buckets))
        not_meaningful(mode_records, workload.adapters(), noop)
        mode_records = [r for r in mode_records if r.property in selected]
        elapsed = time.perf_counter() - start
        for rec in mode_records:
            rec.details.setdefault("mode_seconds", round(elapsed, 2))
        if mode in config.modes:
            results += mode_records
            for rec in mode_records:
                notify(rec)
    if config.state_machine_examples and STATEFUL in selected:
        if not effects_known:  # no workload ran: the no-op test without base weights (exact zeros)
            adapter_effects(_ReadOnly(adapters, info.config))
        records = run_stateful(backend, model_dir, adapters, config=config, max_loras=max_loras, dtype=dtype,
                               device=device, model_name=name)
        not_meaningful(records, set(adapters), noop)
        for rec in records:
            rec.repro = rerun(None)
            results.append(rec)
            notify(rec)
    return results


def _locate(rec: E2EResult, located: dict, *, workload, served: Served, reload_weights, dtype: str, make,
            capacity: int) -> None:
    """Append to failed record ``rec`` where its request first departs from the reference engine
    (:func:`.locate.locate`; once per mode and request); kept in ``details["where"]`` too."""
    from moelora_conformance.e2e.locate import failing_request, locate

    start = time.perf_counter()
    key = (rec.mode, failing_request(rec.message) or "")
    if key not in located:
        located[key] = locate(rec.message, workload=workload, make_engine=make, reload_weights=reload_weights,
                              reference=served.reference, mode=rec.mode, dtype=dtype, capacity=capacity)
    where = located[key]
    if where:
        rec.message = f"{rec.message[:300]} | where: {where}"
        rec.details["where"] = where
    rec.details["locate_seconds"] = round(time.perf_counter() - start, 2)


class _ReadOnly:
    """``adapter_effect(name)`` of adapters read for a model without an engine (exact-zero tests only)."""

    def __init__(self, adapters: dict[str, Path], model_config) -> None:
        self.adapters, self.model_config = adapters, model_config

    def adapter_effect(self, name: str):
        from moelora_core.checkpoint import adapter_effect, read_adapter

        return adapter_effect(read_adapter(Path(self.adapters[name]), self.model_config, name=name))


def _hf_reference(model_dir: Path, adapters: dict[str, Path], hf: bool, dtype: str,
                  device: str) -> tuple[HFReference | None, str]:
    if not hf:
        return None, "HF + PEFT comparison off (--no-hf)"
    missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        return None, f"{' and '.join(missing)} not installed (the 'fixtures' extra)"
    from moelora_conformance.hf_check.hf_w8a8 import fp8_block
    from moelora_core import logprob_tolerance

    # an fp8 block-scaled base: transformers' dequantized model made w8a8 (hf_check.hf_w8a8, DESIGN.md §9)
    w8a8 = fp8_block(model_dir) is not None
    try:
        logprob_tolerance("engine_vs_hf", dtype, base_quant="fp8_block" if w8a8 else "none")
    except KeyError as exc:
        return None, str(exc)
    return HFReference(model_dir, adapters, w8a8=w8a8), ""


def run_stateful(backend: str, model_dir: Path, adapters: dict[str, Path], *, config: E2EConfig, max_loras: int,
                 dtype: str, device: str, model_name: str) -> list[E2EResult]:
    """E06 through ``moelora_conformance.e2e.stateful.run_state_machine``; one ``not_run`` record when
    that module is not installed (never a silent pass); its import or run failing is a failure."""
    base = E2EResult(STATEFUL, backend, "mixed", DTYPE_NAMES.get(dtype, dtype), model_name)
    if importlib.util.find_spec(STATEFUL_MODULE) is None:
        return [base.not_run("state machine not available (moelora_conformance.e2e.stateful is not installed)")]
    start = time.perf_counter()
    try:
        module = importlib.import_module(STATEFUL_MODULE)
        records = list(module.run_state_machine(backend=backend, model_dir=model_dir, adapters=adapters,
                                                max_examples=config.state_machine_examples, max_loras=max_loras,
                                                device=device, dtype=dtype))
    except Exception as exc:  # a crash of the machine itself is a failure of E06, named
        base.duration = time.perf_counter() - start
        return [base.failed(f"{type(exc).__name__}: {exc}")]
    return records or [base.failed("run_state_machine returned no record")]
