"""The real-checkpoint pass: every backend × layer mode on real tiny MoE checkpoints and real PEFT
adapters, against the oracle and against HF transformers + PEFT per adapter (the main job, DESIGN.md §8).

For every fixture model (Qwen3-MoE — the H = 2·I one included —, Mixtral, OLMoE, Qwen2-MoE; per-expert
and fused expert layouts):

1. the adapters of :mod:`.adapters` (three of different ranks made here, one rsLoRA, one legacy
   per-expert, plus the model's fixture adapters) are read from disk by ``moelora_core.checkpoint``
   into one slot each of every layer's pool (fp32, R = 16);
2. per decoder layer, the layer's base weights come from the checkpoint readers, and two batches of
   :mod:`.batches` (more than 32 requests, extend lengths above 1, every adapter and base requests)
   get fresh activations and dense inputs; routing is the checkpoint's own router (transformers'
   gate module) on those activations;
3. per backend and layer mode — ``eager`` (both batches), ``decode`` (the DECODE batch, decode
   graph family), ``prefill-full`` and ``prefill-breakable`` (the EXTEND batch, prefill family) — the
   suite's layer harness runs the layer (dense LoRA projection → break op → MoE, graph modes through
   the graph API with capacities a little above the batch) and checks it against the oracle with the
   suite's standard checks (outputs, LoRA deltas, base rows and pad rows bit-identical to the
   LoRA-disabled run);
4. the same run against HF + PEFT (for the shared-outer / fully shared fixture adapters, which peft
   cannot load, the per-module reference built from their own tensors): for each adapter, the rows
   of its requests — the MoE output against the PEFT-wrapped experts module fed the run's own MoE
   input and routing, each dense output against the PEFT-wrapped projection — and the base
   requests' rows against the model without adapter; fp32, the tolerance policy's bounds (max and
   RMS relative error <= 1e-5).

Qwen2-MoE's shared expert enters the layer spec as three more dense modules (shared_gate, shared_up,
shared_down): the harness runs them in its projection step like q/k/v/o, on every backend and mode,
and each is compared with the PEFT-wrapped ``mlp.shared_expert.<leaf>``; the MoE part stays the
routed experts (``hf.mlp.experts``). The gated composition of the two is checked by ``hf-check``
(the whole ``Qwen2MoeSparseMoeBlock``) and by the engine tests (whole-model logprobs).
DeepSeek-V3: its MLA projections and ungated shared experts are dense modules alike; its dense first
layers have no MoE block for the harness and are left to ``hf-check``.

An fp8 block-scaled fixture (the manifest's ``quantized_from``; DESIGN.md §1) is served with its
source model's pass adapters. Its MoE blocks run the w8a8 base (fp8 experts, activations quantized
per token per K-group) and are checked against the oracle's w8a8 under the policy's fp8 rows; their
HF rows are left out (transformers on a CPU computes the dequantized weights without activation
quantization: ``hf-check`` compares that). Its dense projections enter the harness dequantized
(the harness's projection step is a plain GEMM; their w8a8 is the engine's). A backend that does not
declare ``base_quant=fp8_block`` gets one row saying it was refused at start-up
(``UnsupportedBaseQuantError``), as the engine refuses it.

Every comparison is a :class:`PassRow`; :func:`run_checkpoint_pass` returns them all and
:mod:`.table` prints the summary. Needs the ``fixtures`` extra (transformers + peft).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora_conformance.checkpoint_pass.adapters import PassAdapter, build_pass_adapters
from moelora_conformance.checkpoint_pass.batches import PASS_REQUESTS, decode_batch, extend_batch
from moelora_conformance.fixtures.manifest import FixtureSet
from moelora_conformance.harness import BatchInputs, CheckContext, GraphLayer, Layer, Oracle, check_run
from moelora_conformance.strategies.cases import MaterializedCase
from moelora_conformance.user_files import pool_max_rank
from moelora_core import (
    DEFAULT_POLICY,
    NO_ADAPTER,
    BatchSpec,
    ForwardMode,
    InvalidFieldError,
    LoRAWeights,
    UnsupportedBaseQuantError,
    load_backend,
)
from moelora_core.backend import check_base_quant_served
from moelora_core.checkpoint import MoECheckpoint, load_adapter_into_slot, read_adapter

F32 = torch.float32
#: Layer modes of the pass (the harness's).
MODES: tuple[str, ...] = ("eager", "decode", "prefill-full", "prefill-breakable")
DEFAULT_BACKENDS: tuple[str, ...] = ("reference", "triton", "csgmv")
BASE = "(base)"


@dataclass(frozen=True)
class PassRow:
    """One comparison of the pass.

    Attributes:
        model, backend, mode, layer: where. batch: "extend" or "decode".
        check: "oracle" (the suite's standard checks of the whole run) or "hf" (one adapter's rows
            against HF + PEFT, or the base rows against HF without adapter).
        subject: the adapter ("(base)" for base rows; "all rows" for the oracle).
        part: "layer" (oracle), "moe" or a dense module ("q", "k", "v", "o", "shared_gate", ...).
        max_rel, rms_rel: errors of HF comparisons (None for the oracle's pass/fail checks).
        ok: the comparison passed. note: the first line of a failure.
    """

    model: str
    backend: str
    mode: str
    layer: int
    batch: str
    check: str
    subject: str
    part: str
    max_rel: float | None
    rms_rel: float | None
    ok: bool
    note: str = ""


@dataclass
class _LayerData:
    """One decoder layer of a model: its pool, base weights and the transformers sides."""

    index: int
    pool: LoRAWeights
    base: object  # MoEBaseWeights
    dense: dict[str, torch.Tensor]
    dense_bias: dict[str, torch.Tensor]
    hf_base: object
    hf_adapters: list


def _layer_dense(disk, spec) -> dict[str, torch.Tensor]:
    """[out, in] weights of the spec's dense modules that the read layer has (every one, except on
    DeepSeek-V3, whose layers hold either shared experts or a dense MLP)."""
    out = {}
    for m in spec.dense_shapes:
        try:
            out[m] = disk.dense(m)
        except InvalidFieldError:
            continue
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _inputs(layer: _LayerData, batch: BatchSpec, seed: int) -> tuple[MaterializedCase, BatchInputs]:
    """Fresh activations and dense inputs for ``batch``; routing by the checkpoint's router."""
    from moelora_conformance.hf_check.hf_model import hf_route

    spec = layer.pool.spec
    gen = torch.Generator().manual_seed(seed)
    T = batch.num_tokens
    x = torch.randn(T, spec.H, generator=gen)
    with torch.no_grad():
        weights, ids = hf_route(layer.hf_base, x)
    ids, weights = ids.to(torch.int32).contiguous(), weights.to(F32).contiguous()
    # the layer's own dense modules (DeepSeek-V3: its MLA projections and shared experts, not the dense MLP)
    dense_x = {m: torch.randn(T, fin, generator=gen) for m, (fin, _) in spec.dense_shapes.items() if m in layer.dense}
    mapping = torch.tensor(batch.token_lora_mapping, dtype=torch.int32)
    logits = layer.base.router_logits(x)
    m = MaterializedCase(spec=spec, x=x, router_logits=logits, topk_ids=ids, topk_weights=weights, base=layer.base,
                         dense_weights=dict(layer.dense), dense_x=dense_x, lora=layer.pool, token_lora_mapping=mapping)
    return m, BatchInputs(batch, x, ids, weights, dense_x)


def _hf_rows(model: str, backend: str, mode: str, layer: _LayerData, batch_name: str, inp: BatchInputs, run,
             adapters: Sequence[PassAdapter]) -> list[PassRow]:
    """Each adapter's rows (and the base rows) against HF + PEFT."""
    from moelora_conformance.hf_check.hf_model import dense_module

    rows = []
    slots = torch.tensor(inp.batch.token_lora_mapping)
    sides = [(NO_ADAPTER, BASE, layer.hf_base)] + [(s, a.name, layer.hf_adapters[s]) for s, a in enumerate(adapters)]
    fp8 = layer.base.base_quant != "none"  # w8a8 experts: transformers computes w8a16 on a CPU (module doc)
    for slot, name, hf in sides:
        mask = slots == slot
        if not bool(mask.any()):
            continue
        with torch.no_grad():
            want = {} if fp8 else {"moe": hf.mlp.experts(run.moe_in[mask], inp.topk_ids[mask].long(),
                                                         inp.topk_weights[mask])}
            for m, x in inp.dense_x.items():
                # The harness's projection is the GEMM and its LoRA; a bias (Qwen2-MoE q/k/v) is a
                # constant row the engine adds in its base GEMM, checked by hf-check and the engine tests.
                want[m] = dense_module(hf, m)(x[mask])
                if m in layer.dense_bias:
                    want[m] = want[m] - layer.dense_bias[m]
        for part, expected in want.items():
            actual = run.y[mask] if part == "moe" else run.dense[part][mask]
            rep = DEFAULT_POLICY.check(actual, expected.double(), dtype=F32, what=f"{model} {backend} {mode} "
                                       f"L{layer.index} {name} {part}")
            rows.append(PassRow(model, backend, mode, layer.index, batch_name, "hf", name, part, rep.max_rel,
                                rep.rms_rel, rep.ok, "" if rep.ok else rep.message().splitlines()[0]))
    return rows


def _run_mode(factory, backend: str, mode: str, m: MaterializedCase, inp: BatchInputs, seed: int, describe: str):
    """(run, LoRA-disabled twin, whether pad rows are checked) of one forward in ``mode``."""
    layer = Layer(factory, None, "cpu", materialized=m)
    if mode == "eager":
        run = layer.eager(inp)
        return layer, run, layer.disabled(inp, run), False
    batch = inp.batch
    tpr = batch.tokens_per_request if batch.forward_mode is ForwardMode.DECODE else 1
    graph = GraphLayer(layer, mode, max_requests=batch.bs + 2, max_tokens=batch.num_tokens + 8,
                       tokens_per_request=tpr, pad_seed=seed)
    run = graph.run(inp)
    if run.fallback is not None:
        raise AssertionError(f"{mode}: prepare fell back ({run.fallback.reason}) within capacity | {describe}")
    return layer, run, graph.disabled(run), True


def run_model(fixtures: FixtureSet, work_dir: Path, model: str, *, backends: Sequence[str] = DEFAULT_BACKENDS,
              modes: Sequence[str] = MODES, layers: Sequence[int] | None = None,
              num_requests: int = PASS_REQUESTS, progress: Callable[[str], None] | None = None,
              adapters: Sequence[PassAdapter] | None = None) -> list[PassRow]:
    """Every check of the pass on one model (module docstring): a fixture model with the pass's
    adapters, or the given ``adapters`` (a user's, :func:`user_pass_adapters`)."""
    from moelora_conformance.hf_check.hf_model import decoder_layers, load_hf
    from moelora_conformance.hf_check.per_module import merged_reference_model
    from moelora_conformance.hf_check.run import served_layer

    source = fixtures.manifest["models"][model].get("quantized_from", model)  # an fp8 copy: its source's adapters
    adapters = build_pass_adapters(fixtures, work_dir, source) if adapters is None else list(adapters)
    max_rank = pool_max_rank(fixtures)
    model_dir = fixtures.model_dir(model)
    rows: list[PassRow] = []
    with MoECheckpoint(model_dir) as ckpt:
        cfg = ckpt.config
        spec = cfg.layer_spec(max_loras=len(adapters), max_rank=max_rank)
        pools = [LoRAWeights(spec) for _ in range(cfg.num_layers)]
        for slot, a in enumerate(adapters):
            load_adapter_into_slot(pools, slot, read_adapter(a.path, cfg, name=a.name, max_rank=max_rank))
        hf_base = decoder_layers(load_hf(model_dir))
        hf_adapters = [decoder_layers(merged_reference_model(load_hf(model_dir), a.path) if a.origin == "layout"
                                      else load_hf(model_dir, a.path)) for a in adapters]
        # DeepSeek-V3's dense first layers have no MoE block for the layer harness: their MLP's LoRA is
        # compared by hf-check (reference backend, adapter and base rows) instead.
        chosen = [li for li in (range(cfg.num_layers) if layers is None else layers) if cfg.is_moe_layer(li)]
        data = []
        for li in chosen:
            disk = ckpt.layer(li)
            dense = served_layer(disk)  # fp8 dense projections dequantized (module doc); the experts stay fp8
            data.append(_LayerData(li, pools[li], disk.moe, _layer_dense(dense, spec),
                                   {m: b for m in spec.dense_shapes if (b := disk.bias(m)) is not None},
                                   hf_base[li], [hf[li] for hf in hf_adapters]))
    for layer in data:
        ranks, scalings = layer.pool.slot_ranks(), layer.pool.slot_scalings()
        seed = _seed(model, layer.index)
        batches = {"extend": extend_batch(ranks, scalings, num_adapters=len(adapters), num_requests=num_requests,
                                          seed=seed),
                   "decode": decode_batch(ranks, scalings, num_adapters=len(adapters), num_requests=num_requests,
                                          seed=seed)}
        prepared = {name: _inputs(layer, b, seed + i) for i, (name, b) in enumerate(batches.items())}
        for backend in backends:
            factory = load_backend(backend)
            try:
                check_base_quant_served(backend, factory(spec).capabilities(), spec.base_quant)
            except UnsupportedBaseQuantError as exc:
                rows.append(PassRow(model, backend, "start-up", layer.index, "-", "declared", "all rows", "layer",
                                    None, None, True, f"refused at start-up ({type(exc).__name__}: {exc})"))
                continue
            for mode in modes:
                names = ("extend", "decode") if mode == "eager" else ("decode",) if mode == "decode" else ("extend",)
                for batch_name in names:
                    m, inp = prepared[batch_name]
                    describe = (f"{model} L{layer.index} {backend} {mode} {batch_name} bs={inp.batch.bs} "
                                f"T={inp.num_tokens} slots={len(adapters)}")
                    if progress:
                        progress(describe)
                    where = (model, backend, mode, layer.index, batch_name, "oracle", "all rows", "layer", None, None)
                    try:
                        harness, run, base, pad = _run_mode(factory, backend, mode, m, inp, seed, describe)
                    except AssertionError as exc:  # the run itself went wrong (a Fallback within capacity)
                        rows.append(PassRow(*where, False, _first_line(exc)))
                        continue
                    ctx = CheckContext(describe, seed, F32, torch.device("cpu"), base_quant=spec.base_quant)
                    try:
                        check_run(Oracle(harness), inp, run, base, ctx, f"{mode} {batch_name}", pad_rows=pad)
                        rows.append(PassRow(*where, True))
                    except AssertionError as exc:
                        rows.append(PassRow(*where, False, _first_line(exc)))
                    rows += _hf_rows(model, backend, mode, layer, batch_name, inp, run, adapters)
    return rows


def user_pass_adapters(fixtures: FixtureSet) -> tuple[list[PassAdapter], list[str]]:
    """The adapters of a user fixture set (``user_files.user_fixture_set``) the pass compares with
    HF + PEFT, and the names left out: legacy per-expert + rsLoRA, which peft serves with another σ
    (DESIGN.md §1; ``hf-check`` compares them against a per-module reference)."""
    kept, skipped = [], []
    for name, entry in fixtures.manifest["adapters"].items():
        if entry["peft_divergent"]:
            skipped.append(name)
            continue
        kept.append(PassAdapter(name, fixtures.adapter_dir(name), entry["format"], int(entry["r"]),
                                bool(entry["use_rslora"]), "user"))
    return kept, skipped


def run_checkpoint_pass(fixtures: FixtureSet, work_dir: str | Path, *, models: Sequence[str] | None = None,
                        skip_models: Sequence[str] = (),
                        backends: Sequence[str] = DEFAULT_BACKENDS, modes: Sequence[str] = MODES,
                        layers: Sequence[int] | None = None, num_requests: int = PASS_REQUESTS,
                        progress: Callable[[str], None] | None = None) -> list[PassRow]:
    """The pass over ``models`` (default: every fixture model) less ``skip_models``.

    Args:
        fixtures: a built fixtures directory (``moelora-conformance make-fixtures``).
        work_dir: where the pass's own adapters are built (reused when already there).
        skip_models: fixture models left out (the main job leaves out fp8 copies this way, so a model
            added to the fixtures joins it without a list to update).
        backends: backend names or ``module:factory`` targets. modes: a subset of :data:`MODES`.
        layers: decoder layers to check (default: all). num_requests: requests per batch.
        progress: called with a line before each run.

    Raises:
        ValueError: an unknown mode or model (in ``models`` or ``skip_models``), checked before any run.
    """
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; expected a subset of {MODES}")
    names = sorted(fixtures.manifest["models"]) if models is None else list(models)
    missing = [m for m in [*names, *skip_models] if m not in fixtures.manifest["models"]]
    if missing:
        raise ValueError(f"unknown fixture models {missing}; known {sorted(fixtures.manifest['models'])}")
    names = [m for m in names if m not in skip_models]
    rows: list[PassRow] = []
    for model in names:
        rows += run_model(fixtures, Path(work_dir), model, backends=backends, modes=modes, layers=layers,
                          num_requests=num_requests, progress=progress)
    return rows
