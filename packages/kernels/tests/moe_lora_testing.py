"""MoE-LoRA helpers shared by the kernel tests (not tests themselves): pools, handled-pair masks,
stage inputs (with the columns the delta must not touch poisoned), the twin call and the delta check
(tolerance on the output, bit-identity elsewhere), and the same check with sentinel-padded inputs
and poisoned outputs (:func:`check_sentinel_stage`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close, cpu, launch_guard, poisoned, randn

from moelora_core import EXPERT_FACTORS, EXPERT_LAYOUTS, AlignOutput, LoRALayerSpec, LoRAWeights, ModuleLoRA
from moelora_core.layer_spec import expert_factor
from moelora_core.weights import module_index
from moelora_kernels import (
    MoELoRAInputs,
    configs,
    fused_moe,
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_block_m,
    moe_lora_align_block_size,
    moe_lora_delta,
    stage_tensors,
)
from moelora_reference import moe_lora_ops as twin
from moelora_reference.oracle import moe_lora_forward


def cpu_weights(w: LoRAWeights) -> LoRAWeights:
    """A CPU copy of a pool (the oracle and twins run on the CPU)."""
    spec = w.spec
    out = LoRAWeights(replace(spec, device=torch.device("cpu")))
    for name in EXPERT_FACTORS:
        out.storage(name).copy_(w.storage(name).cpu())
    for name in ("module_ranks", "module_scalings"):
        getattr(out, name).copy_(getattr(w, name).cpu())
    for m in w.dense_A:
        out.dense_A[m].copy_(w.dense_A[m].cpu())
        out.dense_B[m].copy_(w.dense_B[m].cpu())
    return out


def named_routing(seed, spec, M, k, ids=None, mapping=None):
    """(generator, ids [M, k] int32, mapping [M] int32) of a named case on DEVICE: distinct experts per
    token and slots in [-1, L) drawn from ``seed`` where not given; the generator continues the draw."""
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.stack([torch.randperm(spec.E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    if mapping is None:
        mapping = torch.randint(-1, spec.max_loras, (M,), generator=gen, dtype=torch.int32)
    return gen, ids.to(DEVICE), mapping.to(DEVICE)


def enabled_of(mapping: torch.Tensor, L: int) -> torch.Tensor:
    used = torch.zeros(L, dtype=torch.int32)
    for s in mapping.cpu().tolist():
        if s >= 0:
            used[s] = 1
    return used.to(DEVICE)


def handled(stage, ids, mapping, enabled, ranks, E):
    """Bool [S, M·top_k]: pairs (per slice) the delta must reach."""
    ids, mapping, enabled, ranks = ids.cpu(), mapping.cpu().long(), enabled.cpu(), ranks.cpu()
    ranks = ranks if stage == "gate_up" else ranks.unsqueeze(0)
    slot = mapping.repeat_interleave(ids.shape[1])
    e = ids.reshape(-1)
    ok = (slot >= 0) & (e >= 0) & (e < E)
    safe = slot.clamp(min=0)
    ok &= enabled[safe] != 0
    return torch.stack([ok & (ranks[s][safe] > 0) for s in range(ranks.shape[0])])


def stage_inputs(gen, stage, M, k, H, I, dtype, topk_weights):
    """(x, out0, router weights) of a stage: out0 random and small, so the delta dominates the check."""
    if stage == "gate_up":
        return randn(gen, M, H, dtype=dtype), randn(gen, M, k, 2 * I, dtype=dtype, scale=0.1), None
    return randn(gen, M * k, I, dtype=dtype), randn(gen, M, k, H, dtype=dtype, scale=0.1), topk_weights


def run_delta(stage, x, out, weights, align, k, topk_weights, enabled, fused, max_rank=None):
    with launch_guard():
        moe_lora_delta(stage, x, out, weights, align, top_k=k, topk_weights=topk_weights, adapter_enabled=enabled,
                       fused=fused, max_rank=max_rank)
    return out


def twin_delta(stage, x, out0, weights, align, k, topk_weights, enabled, max_rank=None):
    t = stage_tensors(weights, stage)
    return twin.fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out0.clone(), stage=stage, top_k=k,
                               ranks=t["ranks"], scalings=t["scalings"], topk_weights=topk_weights,
                               adapter_enabled=enabled, max_rank=max_rank)


def check_delta(stage, out, want, out0, mask, dtype, seed, what):
    S = mask.shape[0]
    assert_close(out, want, dtype=dtype, what=what, seed=seed)
    width = out.shape[-1] // S
    rows = out.cpu().reshape(mask.shape[1], S, width)
    before = out0.cpu().reshape(mask.shape[1], S, width)
    untouched = ~mask.t()
    assert_bitwise_equal(rows[untouched], before[untouched], what=f"{what}: rows the delta must not touch", seed=seed)


def make_pool(seed, *, L=3, E=5, H=40, I=24, R=16, dtype=torch.float32, ranks=None, sigma=(0.5, 2.0, 1.0),
              layout="per_expert", adapter_layout=None):
    """A pool whose slot s has module ranks ranks[s] = {module: r} (default: all modules rank R).

    ``layout`` is the pool's ``expert_layout``; ``adapter_layout`` (default: ``layout``) the one the
    drawn factors follow: a factor it shares is drawn once, ``[1, r, in]`` / ``[1, out, r]``."""
    gen = torch.Generator().manual_seed(seed)
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=2, dense_shapes={}, max_loras=L,
                         max_rank=R, dtype=dtype, device=DEVICE, expert_layout=layout)
    w = LoRAWeights(spec)
    load_slots(w, drawn_adapters(spec, gen, ranks, sigma, adapter_layout or layout))
    return w


def drawn_adapters(spec, gen, ranks=None, sigma=(0.5, 2.0, 1.0), layout="per_expert"):
    """slot → adapter of random factors (fresh values, never zeros) in expert layout ``layout``."""
    shared = EXPERT_LAYOUTS[layout]
    E, R = spec.E, spec.R
    ranks = ranks or {s: {"gate": R, "up": R, "down": R} for s in range(spec.max_loras)}
    out = {}
    for slot, mods in ranks.items():
        adapter = {}
        for i, (m, r) in enumerate(mods.items()):
            fin, fout = spec.module_shape(m)
            ea = 1 if expert_factor(m, "A") in shared else E
            eb = 1 if expert_factor(m, "B") in shared else E
            adapter[m] = ModuleLoRA(torch.randn(ea, r, fin, generator=gen) / math.sqrt(fin),
                                    torch.randn(eb, fout, r, generator=gen) / math.sqrt(r), sigma[i % len(sigma)] + slot)
        out[slot] = adapter
    return out


def load_slots(w, adapters):
    for slot, adapter in adapters.items():
        w.load_slot(slot, adapter)
    return w


def column_mask(mask, width):
    """Bool [M·top_k, S·N] from the per-slice pair mask [S, M·top_k]: the columns the delta reaches."""
    S, P = mask.shape
    return mask.t()[:, :, None].expand(P, S, width).reshape(P, S * width)


def poison_untouched(gen, out0, cols):
    """out0 with every column the delta must not touch set to NaN or -0.0 (drawn per element)."""
    flat = out0.reshape(cols.shape).clone()
    nan_or_neg_zero = torch.where(torch.rand(cols.shape, generator=gen) < 0.5, float("nan"), -0.0).to(flat.dtype)
    flat[~cols.to(flat.device)] = nan_or_neg_zero[~cols].to(flat.device)
    return flat.reshape(out0.shape)


def poisoned_stage_problem(w, ids, mapping, enabled, dtype, seed, stage):
    """One stage's problem for a pool ``w`` and routing: (alignment with ``enabled``, x, out0, router
    weights or None, columns [M·top_k, S·N] the delta reaches) with fresh inputs from ``seed`` and every
    other column of out0 poisoned (:func:`poison_untouched`)."""
    spec = w.spec
    M, k = ids.shape
    gen = torch.Generator().manual_seed(seed)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, spec.E, moe_block_m(M, k, spec.E, spec.max_loras),
                                          spec.max_loras, enabled)
    tw = torch.rand(M, k, generator=gen).to(DEVICE) if stage == "down" else None
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, dtype, tw)
    mask = handled(stage, ids, mapping, enabled, stage_tensors(w, stage)["ranks"], spec.E)
    cols = column_mask(mask, out0.shape[-1] // mask.shape[0])
    return align, x, poison_untouched(gen, out0, cols), tw, cols


def poison_past_rank(w):
    """NaN in every A row and B column past its slot's module rank (the pool zero-pads them when it
    loads a slot): a kernel that lets one of them reach an output turns it NaN."""
    ranks = w.module_ranks.cpu()
    nan = float("nan")
    for slot in range(w.spec.max_loras):
        for s, module in enumerate(("gate", "up")):
            r = int(ranks[module_index(module), slot])
            w.storage("gate_up_A")[s, slot, :, r:, :] = nan
            w.storage("gate_up_B")[s, slot, :, :, r:] = nan
        r = int(ranks[module_index("down"), slot])
        w.storage("down_A")[slot, :, r:, :] = nan
        w.storage("down_B")[slot, :, :, r:] = nan
    return w


def poison_intermediate_past_rank(inter, stage, mapping, k, ranks, max_rank):
    """The pair's intermediate [S, P, R] with NaN in the columns of each pair past its slot's rank
    (the shrink writes zeros there)."""
    ranks = (ranks if stage == "gate_up" else ranks[None]).cpu()
    slot_of = mapping.cpu().long().repeat_interleave(k)
    parts = inter[None]
    for s in range(ranks.shape[0]):
        for slot in range(ranks.shape[1]):
            r = min(int(ranks[s, slot]), max_rank if max_rank is not None else inter.shape[-1])
            rows = (slot_of == slot).nonzero().squeeze(1).to(inter.device)
            parts[:, s, rows, r:] = float("nan")
    return inter


def shrink_for_pair(stage, x, w, align, k, enabled, mapping, max_rank):
    """The pair's intermediate, NaN in every row the shrink does not write and past each rank."""
    t = stage_tensors(w, stage)
    S = 2 if stage == "gate_up" else 1
    pairs = x.shape[0] * k if stage == "gate_up" else x.shape[0]
    inter = poisoned(S, pairs, w.spec.R, dtype=x.dtype)
    with launch_guard():
        fused_moe_lora_shrink(x, t["lora_a"], align, stage=stage, top_k=k, ranks=t["ranks"], adapter_enabled=enabled,
                              out=inter, max_rank=max_rank)
    return poison_intermediate_past_rank(inter, stage, mapping, k, t["ranks"], max_rank)


def slot_ranks(draw, L, R):
    """Drawn module ranks per slot for :func:`make_pool` (Hypothesis ``draw``): slot 0 always loaded, the
    others 3 times in 4; each module present 4 times in 5 with a rank in [1, R] (a slot with none gets
    down at R): modules absent (rank 0) and empty slots."""
    ranks = {}
    for slot in range(L):
        if slot and not draw(st.integers(0, 3), label=f"slot {slot} loaded"):
            continue
        mods = {m: draw(st.integers(1, R), label=f"slot {slot} {m} rank") for m in ("gate", "up", "down")
                if draw(st.integers(0, 4), label=f"slot {slot} has {m}")}
        ranks[slot] = mods or {"down": R}
    return ranks


def table_copy_with(source, tmp_path, *, keys, ops, fused) -> str:
    """A copy of the config table ``source`` under ``tmp_path`` with ``keys`` set on every entry of ``ops`` (an op
    it has no entry for gets one for every shape) and ``moe_lora_path`` FUSED = ``fused``; returns its path (a
    file of its own per content, so the table cache never serves an older copy)."""
    table = json.loads(Path(source).read_text())
    for op in ops:
        for entry in table.setdefault(op, [{}]):
            entry.update(keys)
    table["moe_lora_path"] = [{"FUSED": fused}]
    text = json.dumps(table)
    path = tmp_path / f"table-{hashlib.sha1(text.encode()).hexdigest()[:12]}.json"
    path.write_text(text)
    return str(path)


def check_layer_with_table(seed, monkeypatch, tmp_path, *, keys, ops, fused, what, H=40, I=24):
    """The whole layer (``fused_moe`` with ``MoELoRAInputs``) against the fp64 oracle with config ``keys``
    set through the config table the shipped launcher reads: on every entry of ``ops`` in a copy of the
    H200 table (``MOELORA_KERNEL_CONFIGS``, read on a GPU) and in the interpreter's one config (read on the
    CPU), with ``moe_lora_path`` FUSED = ``fused`` (the delta path). fp32, mixed ranks, 29 tokens, top_k 2."""
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", table_copy_with(configs._CONFIG_DIR / "h200.json", tmp_path,
                                                                 keys=keys, ops=ops, fused=fused))
    for key, value in {**keys, "FUSED": fused}.items():
        monkeypatch.setitem(configs.INTERPRETER_CONFIG, key, value)
    for op in ops:
        for key, value in keys.items():
            assert configs.kernel_config(op, rows=8)[key] == value, (op, key)
    ranks = {0: {"gate": 3, "up": 16, "down": 9}, 1: {"gate": 8, "down": 1}, 2: {"gate": 13, "up": 4, "down": 16}}
    w = make_pool(seed, L=3, H=H, I=I, R=16, ranks=ranks)
    spec = w.spec
    gen, ids, mapping = named_routing(seed, spec, 29, 2)
    tw = torch.softmax(torch.randn(29, 2, generator=gen), -1).to(DEVICE)
    x = torch.randn(29, spec.H, generator=gen).to(DEVICE)
    w_gu = (torch.randn(spec.E, 2 * spec.I, spec.H, generator=gen) / math.sqrt(spec.H)).to(DEVICE)
    w_d = (torch.randn(spec.E, spec.H, spec.I, generator=gen) / math.sqrt(spec.I)).to(DEVICE)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, spec.E, moe_block_m(29, 2, spec.E, spec.max_loras),
                                          spec.max_loras)
        y = fused_moe(x, ids, tw, w_gu, w_d, deltas=MoELoRAInputs(w, align))
    want = moe_lora_forward(cpu(x), cpu(ids), cpu(tw), cpu(w_gu), cpu(w_d), cpu_weights(w), cpu(mapping))
    assert_close(y, want, dtype=torch.float32, what=f"layer, {what} vs oracle", seed=seed)


def qwen3_pair_args(kernel, R, M=128, L=4, E=128, H=2048, I=768, block_m=16):
    """Runtime arguments of the shrink or the expand (column tiles of 128) for the Qwen3-30B-A3B gate_up
    stage (bf16), for ``compile_for_h200``."""
    P = -(-(M * 8 + E * (block_m - 1)) // block_m) * block_m
    meta = {n: "i32" for n in ("sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr",
                               "adapter_enabled_ptr", "ranks_ptr")}
    common = {"rank_bound": R, "num_pairs": M * 8, "num_experts": E, "stride_sorted": P,
              "stride_expert_ids": P // block_m, "stride_rank_s": L, "L": L,
              "slot_blocks_bound": M * 8 // block_m + min(E, M * 8)}
    if kernel == "shrink":
        return meta | common | {
            "x_ptr": "bf16", "a_ptr": "bf16", "a_desc": None, "inter_ptr": "bf16", "K": H, "R": R, "in_row_div": 8,
            "stride_xm": H, "stride_as": L * E * R * H, "stride_al": E * R * H, "stride_ae": R * H, "stride_ar": H,
            "stride_is": M * 8 * R, "stride_im": R,
        }
    return meta | common | {
        "inter_ptr": "bf16", "b_ptr": "bf16", "out_ptr": "bf16", "topk_weights_ptr": "fp32", "scalings_ptr": "fp32",
        "N": I, "num_n_tiles": -(-I // 128), "stride_is": M * 8 * R, "stride_im": R,
        "stride_bs": L * E * I * R, "stride_bl": E * I * R, "stride_be": I * R, "stride_bn": R,
        "stride_om": 2 * I, "stride_os": I, "stride_on": 1, "stride_scaling_s": L,
    }


def qwen3_gate_up_args(R, M=128, L=4, E=128, H=2048, I=768, block_m=16):
    """The fused kernel's runtime arguments for the Qwen3-30B-A3B gate_up stage (bf16, 4 slots), for
    ``compile_for_h200`` (no A descriptor: ``a_desc`` None)."""
    P = -(-(M * 8 + E * (block_m - 1)) // block_m) * block_m
    ptrs = {n: "bf16" for n in ("x_ptr", "a_ptr", "b_ptr", "out_ptr")}
    ptrs |= {n: "fp32" for n in ("topk_weights_ptr", "scalings_ptr")}
    ptrs |= {n: "i32" for n in ("sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr",
                                "adapter_enabled_ptr", "ranks_ptr")}
    return ptrs | {
        "a_desc": None, "K": H, "N": I, "R": R, "rank_bound": R, "num_pairs": M * 8, "in_row_div": 8, "num_experts": E,
        "stride_xm": H, "stride_as": L * E * R * H, "stride_al": E * R * H, "stride_ae": R * H, "stride_ar": H,
        "stride_bs": L * E * I * R, "stride_bl": E * I * R, "stride_be": I * R, "stride_bn": R,
        "stride_om": 2 * I, "stride_os": I, "stride_on": 1,
        "stride_sorted": P, "stride_expert_ids": P // block_m, "stride_rank_s": L, "stride_scaling_s": L,
        "L": L, "slot_blocks_bound": M * 8 // block_m + min(E, M * 8),
    }


def sentinel_align(align: AlignOutput, num_pairs: int) -> AlignOutput:
    """``align`` copied into buffers with one sentinel slot just past its last: count P, every block
    expert 0, every row a real pair (``p % num_pairs``). A kernel that reads a block past the last
    slot's row, or a slot past L, adds a delta the twin does not (the interpreter does not flag a read
    outside a tensor). Records ``align``'s pair and expert counts."""
    L, P = align.sorted_token_ids.shape
    dev = align.sorted_token_ids.device
    rows = torch.empty(L + 1, P, dtype=torch.int32, device=dev)
    rows[:L], rows[L] = align.sorted_token_ids, torch.arange(P, device=dev) % num_pairs
    experts = torch.zeros(L + 1, align.expert_ids.shape[1], dtype=torch.int32, device=dev)
    experts[:L] = align.expert_ids
    counts = torch.full((L + 1,), P, dtype=torch.int32, device=dev)
    counts[:L] = align.num_tokens_post_padded
    out = AlignOutput(rows[:L], experts[:L], counts[:L])
    return out if align.num_pairs is None else out.set_launch(align.num_pairs, align.num_experts)


def _framed(t: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(view of a copy of ``t``, its buffer): one ``fill`` row before and after the view."""
    buf = torch.full((t.shape[0] + 2, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    buf[1:-1] = t
    return buf[1:-1], buf


def check_sentinel_stage(path, stage, w, ids, mapping, enabled, align, seed, what, *, want_align=None,
                         reached=None):
    """One stage's delta on ``path`` ("fused": ``fused_moe_lora``; "pair": the shrink, then the expand
    on its intermediate) over ``align``, against the twin over ``want_align`` (default ``align``), with
    the inputs sentinel-padded and the outputs poisoned before the launch:

    - x has a NaN row before and after it and ``align`` a sentinel slot (:func:`sentinel_align`), so
      a read outside either shows up in the delta;
    - out has a 7.0 row before and after it (a write outside changes one), and its columns the delta
      must not reach are NaN or -0.0 (:func:`poison_untouched`); the pair's intermediate starts NaN.

    Checks the intermediate (pair) close to the twin's on handled pairs and NaN elsewhere; out close
    to the twin's on the reached columns and bit-identical elsewhere; the frame rows unchanged.
    ``reached`` ([L] int32, default ``enabled``): the slots whose pairs take a delta. Returns (out, out0).
    """
    spec = w.spec
    M, k = ids.shape
    gen = torch.Generator().manual_seed(seed)
    tw = torch.rand(M, k, generator=gen).to(DEVICE) if stage == "down" else None
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, spec.dtype, tw)
    t = stage_tensors(w, stage)
    mask = handled(stage, ids, mapping, enabled if reached is None else reached, t["ranks"], spec.E)
    cols = column_mask(mask, out0.shape[-1] // mask.shape[0])
    out0 = poison_untouched(gen, out0, cols)
    x, _ = _framed(x, float("nan"))
    out, out_buf = _framed(out0, 7.0)
    padded = sentinel_align(align, M * k)
    want_align = align if want_align is None else want_align
    common = {"stage": stage, "top_k": k, "ranks": t["ranks"], "adapter_enabled": enabled}
    with launch_guard():
        if path == "fused":
            fused_moe_lora(x, t["lora_a"], t["lora_b"], padded, out, scalings=t["scalings"], topk_weights=tw,
                           **common)
        else:
            inter = torch.full((mask.shape[0], M * k, spec.R), float("nan"), dtype=spec.dtype, device=DEVICE)
            fused_moe_lora_shrink(x, t["lora_a"], padded, out=inter, **common)
            fused_moe_lora_expand(inter, t["lora_b"], padded, out, scalings=t["scalings"], topk_weights=tw,
                                  **common)
    if path == "pair":
        want_t = twin.fused_moe_lora_shrink(x, t["lora_a"], want_align, **common).cpu()
        got_t = inter.cpu()
        assert_close(got_t[mask], want_t[mask], dtype=spec.dtype, what=f"{what}: intermediate", seed=seed)
        assert bool(got_t[~mask].isnan().all()), f"{what}: intermediate rows of unhandled pairs written (seed={seed})"
    want = twin.fused_moe_lora(x, t["lora_a"], t["lora_b"], want_align, out0.clone(), scalings=t["scalings"],
                               topk_weights=tw, **common)
    got, want, before = (v.cpu().reshape(cols.shape) for v in (out, want, out0))
    assert_close(got[cols], want[cols], dtype=spec.dtype, what=f"{what}: out vs twin", seed=seed)
    assert_bitwise_equal(got[~cols], before[~cols], what=f"{what}: columns the delta must not reach", seed=seed)
    frame = out_buf[[0, -1]]
    assert_bitwise_equal(frame, torch.full_like(frame, 7.0), what=f"{what}: rows around out", seed=seed)
    return out, out0
