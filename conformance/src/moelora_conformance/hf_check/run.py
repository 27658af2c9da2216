"""Run the oracle-vs-HF+PEFT checks over a fixtures directory (DESIGN.md §2; ``docs/checkpoints.md``).

For each fixture model: the oracle without adapter equals the transformers base layer. For each
adapter:

- ``hf-memory``: the oracle fed with weights taken from the in-memory transformers / peft modules
  equals the HF+PEFT forward of that adapter alone;
- ``readers``: the oracle fed from disk by ``moelora_core.checkpoint`` (through
  ``load_adapter_into_slot``) equals the same HF+PEFT forward, and every module's rank and σ equal
  the manifest's;
- ``per-module`` (legacy per-expert adapters): the readers equal a reference with each module's
  delta merged into transformers' weights (DESIGN.md §1);
- for the documented peft divergence (legacy per-expert + rsLoRA): the readers *differ* from
  HF+PEFT on the MoE block, and equal it once gate/up σ is multiplied by √2 (``readers σ·√2``);
- Qwen2-MoE: the MoE block compared is transformers' whole ``Qwen2MoeSparseMoeBlock`` (routed
  experts + gated shared expert), the oracle's side the routed oracle plus its shared-expert twin;
  the shared expert's projections are compared one by one like the attention projections;
- shared-outer / fully shared adapters (the manifest's ``layout_adapters``, which peft cannot load):
  the readers, loaded into a pool of the adapter's expert layout (shared factors stored once per
  slot, read with expert stride 0), equal the per-module reference built from the file's own
  tensors (``per-module``), the detected layout equals the manifest's (a row ``layout``), and the
  reference backend on that pool equals the same reference;
- ``reference-backend``: the readers' pools run through the reference backend on a mixed batch
  (adapter request + base request) equal HF+PEFT on the adapter's rows (the per-module reference
  for the divergent case) and HF without adapter on the base rows.
- ``engine`` (DeepSeek-V3, part ``logprobs``; :mod:`.model_logprobs`): whole-model prompt logprobs
  of the engine on a mixed batch of every adapter and the base model equal HF + PEFT (the
  per-module reference where peft cannot serve the file) within the ``engine_vs_hf`` row.
- fp8 block-scaled models (the manifest's ``quantized_from``; DESIGN.md §1): transformers 5.17 on a
  CPU dequantizes them at load (weights only, no activation quantization), which is right where
  every dimension is a multiple of the block (it infers the block from the scale grid, wrong for
  partial edge blocks). There, the readers' fp8 weights times their scales equal transformers'
  weights exactly (part ``fp8 weights``), and the oracle on those dequantized weights
  (``readers (dequantized)``) equals HF, and HF+PEFT for the source model's adapters
  (:attr:`~moelora_conformance.fixtures.specs.Fp8ModelSpec.adapters`) served on the fp8 model. The
  w8a8 base itself has no HF counterpart on a CPU; rows ``readers (w8a8)`` compare the oracle's w8a8 on
  the layer as read (fp8 experts and projections with their scales) with transformers' model made
  w8a8 (``hf_w8a8``: its fp8 modules' inputs quantized by the oracle's rule, the LoRA deltas on the
  unquantized inputs; a shared expert's fp8 projections w8a8 too), under the policy's fp8 rows — the check
  of the reference E02 uses on an fp8 base. The reference backend's rows, w8a8, are left out here.
  A checkpoint with partial edge blocks (``hf_w8a8.partial_block_weights``; ``deepseek_v3_fp8``), which
  transformers refuses, is loaded from the oracle's dequantized copy (``hf_w8a8.dequantized_copy``): every
  part above runs on it, ``fp8 weights`` as ``fp8 weights (oracle)`` (the readers against the oracle's
  dequantization, which is what transformers then holds).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import torch

from moelora_conformance.fixtures.manifest import FixtureSet
from moelora_conformance.hf_check import hf_model
from moelora_conformance.hf_check.backend_path import compare_backend_layer
from moelora_conformance.hf_check.compare import SLOT, CheckRow, compare_layer
from moelora_conformance.hf_check.extract import base_from_hf, lora_from_peft
from moelora_conformance.hf_check.hf_w8a8 import partial_block_weights
from moelora_conformance.hf_check.model_logprobs import model_logprob_rows
from moelora_conformance.hf_check.per_module import merged_reference_layers
from moelora_conformance.user_files import pool_max_rank
from moelora_core import LoRAWeights, MoEBaseWeights, module_index
from moelora_core.checkpoint import MoECheckpoint, load_adapter_into_slot, read_adapter
from moelora_reference.fp8_block import dequantize_moe, dequantize_weight

BASE = "(base)"


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _hf_side(layer):
    return dict(
        hf_moe=lambda x: hf_model.hf_moe(layer, x),
        hf_route=lambda x: hf_model.hf_route(layer, x),
        hf_dense=lambda m, x: hf_model.hf_dense(layer, m, x),
    )


def _dense(disk, cfg) -> dict:
    """The dense weights [out, in] of a read layer, every dense module of the model (attention and,
    for Qwen2-MoE, the shared expert's projections; DeepSeek-V3: MLA and this layer's shared
    experts or dense MLP)."""
    if cfg.mla is None:
        return {m: disk.dense(m) for m in cfg.dense_shapes}
    mlp = _mlp(disk)
    return {m: disk.dense(m) for m in cfg.dense_shapes
            if not m.startswith(("shared_", "dense_")) or m in mlp.modules}


def _mlp(disk):
    """The read layer's shared expert, or DeepSeek-V3's dense MLP on a dense layer (None for neither)."""
    return disk.shared_expert if disk.shared_expert is not None else disk.dense_mlp


def _bias(disk) -> dict:
    """The biases [out] of a read layer's dense projections that have one (Qwen2-MoE's q/k/v)."""
    return {m: b for m in "qkvo" if (b := disk.bias(m)) is not None}


def served_layer(disk):
    """A read layer as HF computes it on a CPU: fp8 weights dequantized (weights only), else as read."""
    if disk.weight_block is None:
        return disk
    deq = {m: dequantize_weight(disk.dense(m), s, disk.weight_block) for m, s in disk.dense_scales.items()}

    def mlp(weights, prefix: str):  # a shared expert's or DeepSeek-V3's dense MLP's projections
        return None if weights is None else replace(weights, **{f"{m.removeprefix(prefix)}_proj": w
                                                                 for m, w in deq.items() if m.startswith(prefix)})
    mla = disk.mla
    if mla is not None:  # DeepSeek-V3: q (or q_a, q_b), kv_a, kv_b live in the MLA weights (o is the layer's)
        mla = replace(mla, **{f"{m}_proj": w for m, w in deq.items() if m in ("q", "q_a", "q_b", "kv_a", "kv_b")})
    return replace(disk, moe=None if disk.moe is None else dequantize_moe(disk.moe), weight_block=None,
                   dense_scales={}, shared_expert=mlp(disk.shared_expert, "shared_"),
                   dense_mlp=mlp(disk.dense_mlp, "dense_"), mla=mla,
                   **{f"{m}_proj": w for m, w in deq.items() if m in ("q", "k", "v", "o")})


def _fp8_weight_row(model: str, layer: int, disk, hf_moe: MoEBaseWeights | None, hf_dense: dict,
                    partial: bool) -> CheckRow:
    """The readers' fp8 weights times their block scales equal transformers' dequantized weights; with
    ``partial`` edge blocks (transformers loads ``hf_w8a8.dequantized_copy``) the oracle's
    ``fp8_dequantize`` rounded once to fp32, which is what transformers then holds (part ``fp8 weights
    (oracle)``)."""
    served = served_layer(disk)
    pairs = [] if hf_moe is None else [("experts gate_up", served.moe.w_gate_up, hf_moe.w_gate_up),
                                       ("experts down", served.moe.w_down, hf_moe.w_down)]
    pairs += [(m, served.dense(m), hf_dense[m]) for m in disk.dense_scales if m in hf_dense]
    missing = [m for m in disk.dense_scales if m not in hf_dense]  # a module read fp8 that HF has no weight for
    bad = [name for name, ours, theirs in pairs if not torch.equal(ours.float(), theirs.float())] + missing
    theirs = "the oracle's dequantized weights" if partial else "transformers' dequantized weights"
    return CheckRow(model, BASE, "readers", layer, "fp8 weights (oracle)" if partial else "fp8 weights", 0.0, 0.0,
                    None, not bad, "equal", f"differ from {theirs}: {bad}" if bad else "")


def _w8a8_rows(model: str, adapter: str, cfg, disk, pool, hf_layer, seed: int) -> list[CheckRow]:
    """The oracle's w8a8 on the layer as read (fp8 experts and dense projections, their scales; a
    shared expert's fp8 projections w8a8 inside the MoE block and one by one) against transformers'
    model made w8a8 (``hf_w8a8``): routing, the MoE block, each projection."""
    return compare_layer(model=model, adapter=adapter, source="readers (w8a8)", layer=hf_layer[0], moe=disk.moe,
                         dense=_dense(disk, cfg), pool=pool, top_k=cfg.top_k, seed=seed, shared=_mlp(disk),
                         dense_bias=_bias(disk), dense_scales=disk.dense_scales, weight_block=disk.weight_block,
                         **_hf_side(hf_layer[1]))


def _pools(ckpt_config, num_layers: int, max_rank: int) -> list[LoRAWeights]:
    spec = ckpt_config.layer_spec(max_loras=SLOT + 1, max_rank=max_rank)
    return [LoRAWeights(spec) for _ in range(num_layers)]


def check_model_base(fixtures: FixtureSet, model: str) -> list[CheckRow]:
    """The oracle without adapter vs the transformers base layers, weights from memory and from disk."""
    hf = hf_model.load_hf(fixtures.model_dir(model))
    rows: list[CheckRow] = []
    with MoECheckpoint(fixtures.model_dir(model)) as ckpt:
        cfg = ckpt.config
        fp8 = cfg.base_quant != "none"
        w8a8 = hf_model.decoder_layers(hf_model.load_hf(fixtures.model_dir(model), w8a8=True)) if fp8 else []
        partial = bool(partial_block_weights(fixtures.model_dir(model)))
        for li, layer in enumerate(hf_model.decoder_layers(hf)):
            moe, dense, shared, biases = base_from_hf(layer, norm_topk_prob=cfg.norm_topk_prob, routing=cfg.routing)
            disk = ckpt.layer(li)
            if fp8:
                rows.append(_fp8_weight_row(model, li, disk, moe, dense, partial))
                rows += _w8a8_rows(model, BASE, cfg, disk, None, (li, w8a8[li]), _seed(model, li))
                disk = served_layer(disk)
            for source, (m, d, se, b) in (("hf-memory", (moe, dense, shared, biases)),
                                          ("readers (dequantized)" if fp8 else "readers",
                                           (disk.moe, _dense(disk, cfg), _mlp(disk), _bias(disk)))):
                rows += compare_layer(model=model, adapter=BASE, source=source, layer=li, moe=m, dense=d, pool=None,
                                      top_k=cfg.top_k, seed=_seed(model, li), shared=se, dense_bias=b,
                                      **_hf_side(layer))
    return rows


def _rank_sigma_row(model: str, adapter: str, read, expected: dict) -> CheckRow:
    problems = []
    for li, layer in enumerate(read.layers):
        want = expected.get(str(li), {})
        if set(layer) != set(want):
            problems.append(f"L{li}: modules {sorted(layer)} != expected {sorted(want)}")
        for m, lora in layer.items():
            if m in want and (lora.rank != want[m]["rank"] or not math.isclose(lora.scaling, want[m]["scaling"],
                                                                                rel_tol=1e-12)):
                problems.append(f"L{li} {m}: rank {lora.rank} σ {lora.scaling} != expected {want[m]}")
    return CheckRow(model, adapter, "readers", -1, "rank/σ", 0.0, 0.0, None, not problems, "equal",
                    "; ".join(problems[:5]))


def check_adapter(fixtures: FixtureSet, adapter: str, *, model: str | None = None) -> list[CheckRow]:
    """Every check of one fixture adapter (see the module doc); ``model``: serve it on another fixture
    model than its own, an fp8 copy of it (``quantized_from``)."""
    entry = fixtures.adapter(adapter)
    model = model or entry["model"]
    model_dir, adapter_dir = fixtures.model_dir(model), fixtures.adapter_dir(adapter)
    divergent = bool(entry["peft_divergent"])
    max_rank = pool_max_rank(fixtures)
    hf = hf_model.load_hf(model_dir, adapter_dir)
    hf_layers = hf_model.decoder_layers(hf)
    rows: list[CheckRow] = []
    with MoECheckpoint(model_dir) as ckpt:
        cfg = ckpt.config
        # hf-memory: weights from the transformers / peft modules.
        mem_pools = _pools(cfg, cfg.num_layers, max_rank)
        for li, layer in enumerate(hf_layers):
            moe, dense, shared, biases = base_from_hf(layer, norm_topk_prob=cfg.norm_topk_prob, routing=cfg.routing)
            mem_pools[li].load_slot(SLOT, lora_from_peft(layer, intermediate=cfg.moe_intermediate_size))
            rows += compare_layer(model=model, adapter=adapter, source="hf-memory", layer=li, moe=moe, dense=dense,
                                  pool=mem_pools[li], top_k=cfg.top_k, seed=_seed(adapter, li), shared=shared,
                                  dense_bias=biases, **_hf_side(layer))
        # readers: everything from disk through moelora_core.checkpoint.
        read = read_adapter(adapter_dir, cfg, name=adapter, max_rank=max_rank)
        rows.append(_rank_sigma_row(model, adapter, read, entry["modules"]))
        pools = _pools(cfg, cfg.num_layers, max_rank)
        load_adapter_into_slot(pools, SLOT, read)
        fp8 = cfg.base_quant != "none"
        if fp8:  # the layer as read, w8a8, against transformers' model made w8a8 with the same adapter
            w8a8 = hf_model.decoder_layers(hf_model.load_hf(model_dir, adapter_dir, w8a8=True))
            for li in range(cfg.num_layers):
                rows += _w8a8_rows(model, adapter, cfg, ckpt.layer(li), pools[li], (li, w8a8[li]), _seed(adapter, li))
        disk_layers = [served_layer(ckpt.layer(li)) for li in range(cfg.num_layers)]
        for li, layer in enumerate(hf_layers):
            disk = disk_layers[li]
            source = "readers (dequantized)" if fp8 else "readers"
            rows += compare_layer(model=model, adapter=adapter, source=source, layer=li, moe=disk.moe,
                                  dense=_dense(disk, cfg), pool=pools[li], top_k=cfg.top_k, seed=_seed(adapter, li),
                                  shared=_mlp(disk), dense_bias=_bias(disk), **_hf_side(layer),
                                  expect="diverge" if divergent else "equal")
            if divergent:
                # peft's σ on the fused gate_up: 2α/√(2r) = √2 · α/√r.
                gate_up = [module_index("gate"), module_index("up")]
                pools[li].module_scalings[gate_up, SLOT] *= math.sqrt(2.0)
                rows += compare_layer(model=model, adapter=adapter, source="readers σ·√2", layer=li, moe=disk.moe,
                                      dense={}, pool=pools[li], top_k=cfg.top_k, seed=_seed(adapter, li),
                                      shared=_mlp(disk), **_hf_side(layer))
                pools[li].module_scalings[gate_up, SLOT] /= math.sqrt(2.0)
        base_layers = hf_model.decoder_layers(hf_model.load_hf(model_dir))
        lora_layers = hf_layers
        if entry["format"] == "per_expert":
            merged = merged_reference_layers(hf_model.load_hf(model_dir), adapter_dir)
            rows += _per_module_rows(model, adapter, cfg, disk_layers, pools, merged)
            if divergent:
                lora_layers = merged  # moelora serves the file's modules, not peft's converted σ
        if not fp8:  # the reference backend runs the w8a8 base, which HF does not compute on a CPU
            rows += _backend_rows(model, adapter, cfg, disk_layers, pools, lora_layers, base_layers)
    return rows


def _per_module_rows(model: str, adapter: str, cfg, disk_layers: list, pools: list, merged: list) -> list[CheckRow]:
    """Every layer read from disk (``disk_layers``, adapter loaded into ``pools``) against the
    per-module reference ``merged`` built from the adapter file's own tensors."""
    rows: list[CheckRow] = []
    for li, layer in enumerate(merged):
        disk = disk_layers[li]
        rows += compare_layer(model=model, adapter=adapter, source="per-module", layer=li, moe=disk.moe,
                              dense=_dense(disk, cfg), pool=pools[li], top_k=cfg.top_k, seed=_seed(adapter, li),
                              shared=_mlp(disk), dense_bias=_bias(disk), **_hf_side(layer))
    return rows


def _backend_rows(model: str, adapter: str, cfg, disk_layers: list, pools: list, lora_layers: list,
                  base_layers: list) -> list[CheckRow]:
    """The reference backend on every layer against ``lora_layers`` (adapter rows) and ``base_layers``
    (base rows); no rows when the backend is not installed (:func:`backend_available`)."""
    if not backend_available():
        return []
    rows: list[CheckRow] = []
    for li, disk in enumerate(disk_layers):
        rows += compare_backend_layer(model=model, adapter=adapter, layer=li, moe=disk.moe, dense=_dense(disk, cfg),
                                      shared=_mlp(disk), dense_bias=_bias(disk), pool=pools[li],
                                      lora_side=_hf_side(lora_layers[li]), base_side=_hf_side(base_layers[li]),
                                      seed=_seed(adapter, "backend", li))
    return rows


def backend_available() -> bool:
    """Whether the reference backend is importable (it joins the checks when it is)."""
    try:
        import moelora_reference.backend  # noqa: F401
    except ImportError:
        return False
    return True


def check_layout_adapter(fixtures: FixtureSet, adapter: str) -> list[CheckRow]:
    """The checks of one shared-outer / fully shared fixture adapter (see the module doc)."""
    entry = fixtures.layout_adapters()[adapter]
    model = entry["model"]
    model_dir, adapter_dir = fixtures.model_dir(model), fixtures.layout_adapter_dir(adapter)
    max_rank = pool_max_rank(fixtures)
    base = hf_model.load_hf(model_dir)
    merged = merged_reference_layers(base, adapter_dir)
    base_layers = hf_model.decoder_layers(base)
    rows: list[CheckRow] = []
    with MoECheckpoint(model_dir) as ckpt:
        cfg = ckpt.config
        read = read_adapter(adapter_dir, cfg, name=adapter, max_rank=max_rank)
        rows.append(_rank_sigma_row(model, adapter, read, entry["modules"]))
        ok = read.expert_layout == entry["layout"]
        rows.append(CheckRow(model, adapter, "readers", -1, "layout", 0.0, 0.0, None, ok, "equal",
                             "" if ok else f"read as {read.expert_layout}, manifest says {entry['layout']}"))
        spec = replace(cfg.layer_spec(max_loras=SLOT + 1, max_rank=max_rank), expert_layout=entry["layout"])
        pools = [LoRAWeights(spec) for _ in range(cfg.num_layers)]
        load_adapter_into_slot(pools, SLOT, read)
        disk_layers = [ckpt.layer(li) for li in range(cfg.num_layers)]
        rows += _per_module_rows(model, adapter, cfg, disk_layers, pools, merged)
        rows += _backend_rows(model, adapter, cfg, disk_layers, pools, merged, base_layers)
    return rows


def run_hf_check(fixtures: FixtureSet, *, adapters: list[str] | None = None) -> list[CheckRow]:
    """Base checks of every model that an adapter in ``adapters`` (default: all, the layout adapters
    included) uses, then each adapter."""
    layout = fixtures.layout_adapters()
    names = adapters if adapters is not None else sorted(fixtures.manifest["adapters"]) + sorted(layout)
    models = sorted({(layout[a] if a in layout else fixtures.adapter(a))["model"] for a in names}) \
        if adapters is not None else sorted(fixtures.manifest["models"])
    rows: list[CheckRow] = []
    for model in models:
        rows += check_model_base(fixtures, model)
    for adapter in names:
        rows += check_layout_adapter(fixtures, adapter) if adapter in layout else check_adapter(fixtures, adapter)
    for model in models:  # whole-model prompt logprobs, the engine against HF + PEFT (DeepSeek-V3)
        own = [a for a in names if (layout[a] if a in layout else fixtures.adapter(a))["model"] == model]
        rows += model_logprob_rows(fixtures, model, own)
    for model in models:  # an fp8 copy serves its source model's adapters (the spec names which are checked)
        source = fixtures.manifest["models"][model].get("quantized_from")
        for adapter in fp8_adapters(model) if source else ():
            if adapter in fixtures.manifest["adapters"] and (adapters is None or adapter in names):
                rows += check_adapter(fixtures, adapter, model=model)
    return rows


def fp8_adapters(model: str) -> tuple[str, ...]:
    """The adapters hf-check serves on fp8 fixture ``model`` (``Fp8ModelSpec.adapters``; none for a
    model the specs do not list)."""
    from moelora_conformance.fixtures.specs import ALL_FP8_MODELS

    return next((m.adapters for m in ALL_FP8_MODELS if m.name == model), ())
