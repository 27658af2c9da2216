"""A/B of the selectable kernel variants, by the benchmark's method (``sweep_configs.py --variants``).

Two variant families, each chosen on the GPU by config keys per row bucket of
``moelora_kernels/configs/h200.json`` (benchmarks/RESULTS.md, "What limits the misses"):

- (b) MoE-LoRA deltas at M in ``--lora-tokens`` (8, 32, 128, 512) for each R in ``--ranks``: the
  table's paths (``auto`` = ``moe_lora_delta``'s table choice, ``fused`` kernel) against the
  shrink/expand pair at each tile pair (``moe_lora_shrink`` ``BLOCK_K`` in {64, 128};
  ``moe_lora_expand`` ``BLOCK_N`` in {64, 128}), each stage timed alone; then both stages in one
  graph with each stage's best pair config (``best``), against ``auto`` (both stages' deltas: the
  issue's metric).
- (c) ``moe_lora_align_block_size`` (L = 4) and the base ``moe_align_block_size`` at M in
  ``--align-tokens`` (128, 512, 2048) with ``ALIGN_SPLIT`` in {1, 2, 4, 8, 16, 32} (1 = old).

(The shrink split over K and the fused kernel's two slices per program were A/B'd here and left the
kernels: benchmarks/RESULTS.md, "Removed paths".)

Every variant is checked before it is timed: (b) against the benchmark's torch path (bucketed fp32
matmuls, max rel. error ≤ 2e-2 in bf16), (c) against ``ALIGN_SPLIT = 1`` exactly on
``num_tokens_post_padded`` and ``expert_ids`` and on each expert's rows as a multiset (the order
within an expert is free), plus the twin's contract checker for M ≤ 512. A failing check is
recorded (``error``) and the variant is not timed. Timing: ``bench_moe_lora.Timer`` (CUDA graph,
128 MB memset before each replay, median of ``--replays``, 100). Ceilings measured in the same run:
the benchmark's in-graph 2 GiB copy and a plain eager ``copy_`` (median of 20); efficiencies are
reported against the plain one (it is the higher, ~4.3 TB/s on an H200, the in-graph copy ~2.7).

``--families`` picks which of (b), (c) run (default both).

Outputs in ``--out-dir``: ``variants.json`` (rewritten after every unit, so a run cut short keeps
what it measured) with per-unit medians, the winners and ``proposed_h200_entries`` (table entries
to paste into ``configs/h200.json``), and ``log.txt`` (progress, flushed per line).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import os
import platform
import time
from pathlib import Path

import bench_moe_lora as bench
import torch

SHRINK_BLOCK_K = (64, 128)
EXPAND_BLOCK_N = (64, 128)
ALIGN_SPLITS = (1, 2, 4, 8, 16, 32)
#: The current table's pair config (the "old" pair): shrink BLOCK_K 128, expand BLOCK_N 128.
OLD_PAIR = {"BLOCK_K": 128, "BLOCK_N": 128}
#: A shape small enough for the interpreter, with K > BLOCK_K so the shrink takes several K steps.
DRY_MODEL = {"H": 96, "I": 64, "E": 8, "top_k": 2}


class _Log:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, msg: str) -> None:
        line = f"[{datetime.datetime.now(datetime.UTC).strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


class _DryTimer:
    """The CPU stand-in for ``bench_moe_lora.Timer``: one call, wall time (no graph, no flush)."""

    def __call__(self, fn, replays=None):
        t0 = time.perf_counter()
        fn()
        us = (time.perf_counter() - t0) * 1e6
        return {"median_us": us, "p10_us": us, "p90_us": us}


def _pair_variants():
    """(name, shrink config, expand config) of every pair variant; the old pair among them."""
    for bk, bn in itertools.product(SHRINK_BLOCK_K, EXPAND_BLOCK_N):
        yield f"pair_bk{bk}_bn{bn}", {"BLOCK_K": bk}, {"BLOCK_N": bn}


def _stage_args(p, w, stage, h):
    from moelora_kernels import stage_tensors

    t = stage_tensors(w, stage)
    x = p.x if stage == "gate_up" else h
    tw = p.topk_weights if stage == "down" else None
    return t, x, tw


def _run_pair(p, w, stage, h, out, shrink_cfg, expand_cfg):
    from moelora_kernels import fused_moe_lora_expand, fused_moe_lora_shrink

    t, x, tw = _stage_args(p, w, stage, h)
    inter = fused_moe_lora_shrink(x, t["lora_a"], p.lora_align, stage=stage, top_k=p.k, ranks=t["ranks"],
                                  adapter_enabled=p.enabled, config=shrink_cfg)
    return fused_moe_lora_expand(inter, t["lora_b"], p.lora_align, out, stage=stage, top_k=p.k, ranks=t["ranks"],
                                 scalings=t["scalings"], topk_weights=tw, adapter_enabled=p.enabled,
                                 config=expand_cfg)


def _run_delta(p, w, stage, h, out, fused):
    from moelora_kernels import moe_lora_delta

    _, x, tw = _stage_args(p, w, stage, h)
    return moe_lora_delta(stage, x, out, w, p.lora_align, top_k=p.k, topk_weights=tw, adapter_enabled=p.enabled,
                          fused=fused)


def _checked_time(timer, fn, base_out, want, what, tol):
    """Run ``fn(out)`` on a copy of the base buffer, check it, then time it; {} + error on failure."""
    out = base_out.clone()
    try:
        fn(out)
        err = bench.close(out, want, what, tol=tol)
    except Exception as exc:  # a config the GPU cannot run, or a wrong result: recorded, not timed
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out = base_out.clone()
    t = timer(lambda: fn(out))
    return {"us": t["median_us"], "p10_us": t["p10_us"], "p90_us": t["p90_us"], "err": err}


def _us(res, name):
    r = res.get(name) or {}
    return f"{r['us']:.1f}" if "us" in r else "-"


def lora_unit(p, w, R, timer, log, tol):
    """Every (b) variant at one (M, R): per stage, then both stages for ``auto`` and ``best``."""
    gate_up0, h, down0 = p.base_buffers()
    bases = {"gate_up": gate_up0, "down": down0}
    wants = {"gate_up": bench.torch_delta(p, w, "gate_up", p.x, gate_up0),
             "down": bench.torch_delta(p, w, "down", h, down0)}
    unit = {"M": p.M, "R": R, "pairs": p.M * p.k, "block_m": p.bm_lora, "stages": {}}
    for stage in ("gate_up", "down"):
        res = {}
        for name, fused in (("auto", None), ("fused", True)):
            res[name] = _checked_time(timer, lambda o, f=fused, s=stage: _run_delta(p, w, s, h, o, f), bases[stage],
                                      wants[stage], f"{name} {stage} M={p.M} R={R}", tol)
        for name, scfg, ecfg in _pair_variants():
            res[name] = {**_checked_time(timer, lambda o, a=scfg, b=ecfg, s=stage: _run_pair(p, w, s, h, o, a, b),
                                         bases[stage], wants[stage], f"{name} {stage} M={p.M} R={R}", tol),
                         "shrink": scfg, "expand": ecfg}
        timed = {n: r for n, r in res.items() if "us" in r and n.startswith("pair_")}
        best = min(timed, key=lambda n: timed[n]["us"]) if timed else None
        old = "pair_bk{BLOCK_K}_bn{BLOCK_N}".format(**OLD_PAIR)
        unit["stages"][stage] = {"variants": res, "best_pair": best}
        log(f"  (b) M={p.M} R={R} {stage}: auto {_us(res, 'auto')} fused {_us(res, 'fused')} old pair "
            f"{_us(res, old)} best {best} {_us(res, best)} µs")
    # both stages in one graph: the metric, auto vs each stage's best pair config
    both = {"auto": lambda gu, d: (_run_delta(p, w, "gate_up", h, gu, None), _run_delta(p, w, "down", h, d, None))}
    picks = {s: unit["stages"][s]["best_pair"] for s in ("gate_up", "down")}
    if all(picks.values()):
        cfg = {s: unit["stages"][s]["variants"][picks[s]] for s in picks}
        both["best"] = lambda gu, d: (
            _run_pair(p, w, "gate_up", h, gu, cfg["gate_up"]["shrink"], cfg["gate_up"]["expand"]),
            _run_pair(p, w, "down", h, d, cfg["down"]["shrink"], cfg["down"]["expand"]))
    _time_both(unit, both, timer, gate_up0, down0, wants, tol, p, R)
    b = unit["both"]
    log(f"  (b) M={p.M} R={R} both stages: auto {_both_us(b, 'auto')}, best {_both_us(b, 'best')} "
        f"(target {unit['target_us']}) picks {picks}")
    return unit


def _both_us(both: dict, name: str) -> str:
    """A both-stages time for the log; "best" is timed only where each stage has a timed pair."""
    if name not in both:
        return "not timed"
    if "us" not in both[name]:
        return f"failed ({both[name].get('error', '?')})"
    return f"{both[name]['us']:.1f} µs"


def _time_both(unit, both, timer, gate_up0, down0, wants, tol, p, R):
    """Check, then time, each ``both[name](gate_up_out, down_out)`` (both stages in one graph) into
    ``unit["both"]``; sets the unit's ``min_bytes`` and ``target_us`` (the issue's metric)."""
    unit["both"] = {}
    for name, fn in both.items():
        gu, d = gate_up0.clone(), down0.clone()
        try:
            fn(gu, d)
            err = max(bench.close(gu, wants["gate_up"], f"{name} both gate_up", tol=tol),
                      bench.close(d, wants["down"], f"{name} both down", tol=tol))
        except Exception as exc:
            unit["both"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        gu, d = gate_up0.clone(), down0.clone()
        t = timer(lambda fn=fn, gu=gu, d=d: fn(gu, d))
        unit["both"][name] = {"us": t["median_us"], "p10_us": t["p10_us"], "p90_us": t["p90_us"], "err": err}
    unit["min_bytes"] = bench.min_bytes_lora(p, R)
    unit["target_us"] = bench.check_targets.cell_targets(_card_targets(), p.M, R)[1]


@functools.cache
def _card_targets() -> dict | None:
    """This card's targets (``check_targets.for_card``), read once per process; None without a file or a
    GPU (``--dry-run`` on the CPU)."""
    if not torch.cuda.is_available():
        return None
    found = bench.check_targets.for_card(torch.cuda.get_device_name(0))
    return found[1] if found else None


def _per_expert_rows(out, num_pairs, block_m):
    """[L, P] int64: each slot's rows keyed by (block expert, value), sorted: equal for two
    alignments that differ only in the order within an expert."""
    experts = out.expert_ids.long().repeat_interleave(block_m, dim=1)
    key = experts * (num_pairs + 1) + out.sorted_token_ids.long()
    return key.sort(dim=1).values


def align_unit(p, timer, log, dry):
    from moelora_core.align import AlignOutput
    from moelora_kernels import moe_align_block_size, moe_lora_align_block_size
    from moelora_reference.align import check_alignment

    E, L, num_pairs = p.E, bench.MAX_LORAS, p.M * p.k
    runs = {
        "lora": (lambda o, sp: moe_lora_align_block_size(p.topk_ids, p.mapping, E, p.bm_lora, L, p.enabled, out=o,
                                                         config={"ALIGN_SPLIT": sp}), p.lora_align, p.bm_lora),
        "base": (lambda o, sp: moe_align_block_size(p.topk_ids, E, p.bm_base, out=o, config={"ALIGN_SPLIT": sp}),
                 p.base_align, p.bm_base),
    }
    unit = {"M": p.M, "pairs": num_pairs, "block_m_lora": p.bm_lora, "block_m_base": p.bm_base}
    for kind, (fn, ref_out, bm) in runs.items():
        ref = fn(AlignOutput(*(t.clone() for t in ref_out)), 1)
        ref_rows = _per_expert_rows(ref, num_pairs, bm)
        res = {}
        for sp in ALIGN_SPLITS:
            out = AlignOutput(*(torch.full_like(t, 0x3FFF_FFFF) for t in ref_out))
            try:
                fn(out, sp)
                same = (torch.equal(out.num_tokens_post_padded, ref.num_tokens_post_padded)
                        and torch.equal(out.expert_ids, ref.expert_ids)
                        and torch.equal(_per_expert_rows(out, num_pairs, bm), ref_rows))
                if not same:
                    raise AssertionError(f"ALIGN_SPLIT={sp} differs from ALIGN_SPLIT=1 beyond order within an expert")
                if kind == "lora" and (p.M <= 512 or dry):
                    check_alignment(AlignOutput(*(t.cpu() for t in out)), p.topk_ids.cpu(), p.mapping.cpu(), E, bm, L,
                                    p.enabled.cpu())
            except Exception as exc:
                res[sp] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            t = timer(lambda o=out, sp=sp, fn=fn: fn(o, sp))
            res[sp] = {"us": t["median_us"], "p10_us": t["p10_us"], "p90_us": t["p90_us"]}
        timed = {sp: r["us"] for sp, r in res.items() if "us" in r}
        best = min(timed, key=timed.get) if timed else None
        unit[kind] = {"variants": {str(sp): r for sp, r in res.items()}, "best_split": best}
        log(f"  (c) {kind} M={p.M}: " + ", ".join(f"split {sp} {u:.1f}" for sp, u in timed.items()) + " µs")
    return unit


def proposed_entries(record, shape):
    """Table entries (``configs/h200.json``) for the winners: shrink / expand per (K or N, R, bucket),
    ``moe_lora_path`` per (R, bucket) where a pair beats the fused kernel on both stages, the
    alignments' ``ALIGN_SPLIT`` per bucket."""
    H, I = shape["H"], shape["I"]  # noqa: E741
    dims = {"gate_up": (H, I), "down": (I, H)}  # (K of the shrink, N of the expand)
    out = {"moe_lora_shrink": [], "moe_lora_expand": [], "moe_lora_path": [], "moe_lora_align_block_size": [],
           "moe_align_block_size": []}
    for u in record["lora"]:
        pair_wins = True
        for stage, st in u["stages"].items():
            best = st["best_pair"]
            if best is None:
                pair_wins = False
                continue
            v = st["variants"][best]
            K, N = dims[stage]
            out["moe_lora_shrink"].append({"K": K, "R": u["R"], "max_rows": u["pairs"], **v["shrink"],
                                           "num_warps": 4, "num_stages": 4})
            out["moe_lora_expand"].append({"N": N, "R": u["R"], "max_rows": u["pairs"], **v["expand"],
                                           "num_warps": 4, "num_stages": 2})
            fused = st["variants"].get("fused", {}).get("us")
            pair_wins &= fused is None or v["us"] < fused
        out["moe_lora_path"].append({"R": u["R"], "max_rows": u["pairs"], "FUSED": 0 if pair_wins else 1})
    for u in record["align"]:
        for kind, op in (("lora", "moe_lora_align_block_size"), ("base", "moe_align_block_size")):
            if u.get(kind, {}).get("best_split") is not None:
                out[op].append({"max_rows": u["pairs"], "ALIGN_SPLIT": u[kind]["best_split"]})
    return out


def run_variants(args) -> int:
    dry = args.dry_run
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = _Log(out_dir / "log.txt")
    t0 = time.time()
    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("sweep_configs --dry-run: set TRITON_INTERPRET=1 (the kernels run in the interpreter)")
        bench.DEVICE, bench.DT = "cpu", torch.float32
        shape, timer, tol = DRY_MODEL, _DryTimer(), 1e-4
        lora_tokens, align_tokens, ranks = [8], [8], [16]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("sweep_configs --variants: needs a CUDA device (or --dry-run)")
        shape, timer, tol = bench.MODELS["qwen3-30b-a3b-layer"], bench.Timer(args.replays), 2e-2
        lora_tokens, align_tokens, ranks = args.lora_tokens, args.align_tokens, args.ranks
    import triton

    families = set(args.families)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "dry_run": dry,
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name(0) if not dry else "cpu (interpreter)", "shape": shape,
              "replays": args.replays if not dry else 1, "families": sorted(families), "lora": [], "align": [],
              "skipped": []}
    path = out_dir / "variants.json"

    def save():
        record["wall_s"] = round(time.time() - t0, 1)
        record["proposed_h200_entries"] = proposed_entries(record, shape)
        path.write_text(json.dumps(record, indent=2))

    log(f"variants: {'DRY RUN (CPU interpreter, tiny shapes)' if dry else record['gpu']}; families "
        f"{sorted(families)}; lora M {lora_tokens} R {ranks}, align M {align_tokens}; budget {args.budget_s:.0f} s")
    if not dry:
        record["copy_in_graph"] = bench.copy_bandwidth(timer)
        record["copy_plain"] = bench.plain_copy_ceiling()
        log(f"  ceilings: plain copy_ {record['copy_plain']['GBps']:.0f} GB/s (efficiencies use this), "
            f"in-graph copy {record['copy_in_graph']['GBps']:.0f} GB/s")
    gen = torch.Generator(bench.DEVICE).manual_seed(0)
    H, I, E = shape["H"], shape["I"], shape["E"]  # noqa: E741
    base = {"w_gu": (torch.randn(E, 2 * I, H, generator=gen, device=bench.DEVICE) / math.sqrt(H)).to(bench.DT),
            "w_d": (torch.randn(E, H, I, generator=gen, device=bench.DEVICE) / math.sqrt(I)).to(bench.DT)}

    def over_budget(what):
        if time.time() - t0 > args.budget_s:
            record["skipped"].append(what)
            log(f"  budget spent: skipping {what}")
            return True
        return False

    for M in align_tokens if "c" in families else []:  # (c) first: cheap
        if over_budget(f"align M={M}"):
            continue
        p = bench.Problem(M, shape, gen, base)
        record["align"].append(align_unit(p, timer, log, dry))
        save()
        del p
    pools = {R: bench.make_pool(shape, R, gen) for R in ranks} if "b" in families else {}
    for M in lora_tokens if "b" in families else []:
        p = bench.Problem(M, shape, gen, base)
        for R in ranks:
            if over_budget(f"lora M={M} R={R}"):
                continue
            u = lora_unit(p, pools[R], R, timer, log, tol)
            if "copy_plain" in record:
                for r in u["both"].values():
                    if "us" in r:
                        r["frac_plain_copy"] = (u["min_bytes"] / (r["us"] * 1e-6) / 1e9
                                                / record["copy_plain"]["GBps"])
            record["lora"].append(u)
            save()
        del p
        if not dry:
            torch.cuda.empty_cache()
    save()
    log(f"wrote {path} ({record['wall_s']} s); proposed entries in 'proposed_h200_entries'")
    errors = [f"lora M={u['M']} R={u['R']} {s} {n}" for u in record["lora"] for s, st in u["stages"].items()
              for n, r in st["variants"].items() if "error" in r]
    errors += [f"align M={u['M']} {k} split {sp}" for u in record["align"] for k in ("lora", "base")
               for sp, r in u[k]["variants"].items() if "error" in r]
    errors += [f"lora M={u['M']} R={u['R']} both {n}" for u in record["lora"]
               for n, r in u["both"].items() if "error" in r]
    if errors:
        log(f"  {len(errors)} variants failed their check or launch: {errors[:8]}")
    return 0
