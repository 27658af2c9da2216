"""A/B of one kernel-config key: ``bench_moe_lora.py`` once per value, each on a copy of the shipped
table with the key set on every entry of the named operations (through ``MOELORA_KERNEL_CONFIGS``).

    PYTHONPATH=... python benchmarks/config_ab.py --out-dir OUT --key EXPAND_LOADS --values 2 0 1 \\
        --ops fused_moe_lora -- --tokens 1 8 32 128 512 --no-baseline

Writes ``OUT/<key>_<value>.json`` (the benchmark's JSON) and ``.log`` per value, then prints, per
(M, R), the benchmark's ``a_us`` (the base fused MoE, for ``--ops fused_moe_gemm``) and ``b_us``
(and ``b_idle_us`` / ``b_fused_us`` / ``b_unfused_us`` when present) of each value side by side,
with each value's ratio to the first (the baseline: list today's value first), and writes them as
``OUT/<key>_ab.json``. Values run one after another in separate processes (the table is read once per
process); ``--budget-s`` stops starting values after that many seconds (a device call's limit), so list
the values that matter most first.
Only for a GPU host; the rows' ``err_*`` checks run inside the benchmark as usual.

The expand's factor loads (``EXPAND_STREAM``: 0 today, 1 16-byte loads, 2-4 also a pipelined expand
loop; both delta paths, so the auto, fused and pair columns all move):

    PYTHONPATH=... python benchmarks/config_ab.py --out-dir OUT --key EXPAND_STREAM --values 0 1 2 3 \
        --ops moe_lora_expand fused_moe_lora -- --tokens 8 32 128 512 --ranks 16 64 --no-baseline

The base GEMM's weight tiles through a TMA descriptor (``W_DESC``; the base column a moves):

    PYTHONPATH=... python benchmarks/config_ab.py --out-dir OUT --key W_DESC --values 0 1 \
        --ops fused_moe_gemm -- --tokens 1 8 32 128 512 2048 8192 --ranks 16 --no-baseline

The MoE-LoRA shrink's A tiles through a TMA descriptor (``A_DESC``; the deltas' column b moves):

    PYTHONPATH=... python benchmarks/config_ab.py --out-dir OUT --key A_DESC --values 0 1 \
        --ops fused_moe_lora moe_lora_shrink -- --tokens 1 8 32 128 512 2048 8192 --ranks 16 64 --no-baseline

Programmatic dependent launch (``PDL``, every op of the fused MoE layer; a, b and c all move, most where
launches cost as much as the work):

    PYTHONPATH=... python benchmarks/config_ab.py --out-dir OUT --key PDL --values 0 1 \\
        --ops moe_align_block_size moe_lora_align_block_size fused_moe_gemm quantize_activation_fp8 \\
        moe_epilogue moe_lora_shrink moe_lora_expand fused_moe_lora -- --tokens 1 8 32 128 512 \\
        --ranks 16 64 --no-baseline
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: Row fields compared side by side when present.
FIELDS = ("a_us", "b_us", "b_idle_us", "b_fused_us", "b_unfused_us", "a_fp8_us", "ab_fp8_us")


def table_with(key: str, value: int, ops: list[str]) -> dict:
    """The shipped table of this machine's card (``moelora_kernels.configs.device_table_path``) with
    ``key = value`` on every entry of ``ops``.

    Raises:
        SystemExit: an op the table does not have, or a key the launchers do not read (a typo would
            otherwise A/B nothing: ``kernel_config`` keeps only the keys of ``GPU_FALLBACK_CONFIG``).
    """
    from moelora_kernels.configs import GPU_FALLBACK_CONFIG, device_table_path

    if key not in GPU_FALLBACK_CONFIG:
        raise SystemExit(f"config_ab: {key!r} is not a kernel-config key (one of {sorted(GPU_FALLBACK_CONFIG)})")
    path = Path(device_table_path())
    table = json.loads(path.read_text())
    for op in ops:
        if op not in table:
            raise SystemExit(f"config_ab: {op!r} is not an operation of {path.name}")
        for entry in table[op]:
            entry[key] = value
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--values", type=int, nargs="+", required=True)
    parser.add_argument("--ops", nargs="+", required=True)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no value after this many seconds (the values run so far are compared)")
    args = parser.parse_args(own)
    t0 = time.monotonic()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for value in args.values:
        if args.budget_s is not None and time.monotonic() - t0 > args.budget_s:
            print(f"{args.key}={value}: not started (--budget-s {args.budget_s:g} spent)", flush=True)
            continue
        cfg = out / f"table_{args.key}_{value}.json"
        cfg.write_text(json.dumps(table_with(args.key, value, args.ops)))
        stem = out / f"{args.key}_{value}"
        env = os.environ | {"MOELORA_KERNEL_CONFIGS": str(cfg)}
        cmd = [sys.executable, str(Path(__file__).parent / "bench_moe_lora.py"), "--out", f"{stem}.json", *bench_args]
        with open(f"{stem}.log", "w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{args.key}={value}: rc {rc} ({time.monotonic() - t0:.0f} s)", flush=True)
        if rc == 0:
            results[value] = {(r["M"], r["R"]): r for r in json.loads(Path(f"{stem}.json").read_text())["rows"]}
    if not results:
        return 1
    summary = side_by_side(results)
    (out / f"{args.key}_ab.json").write_text(json.dumps(
        {"key": args.key, "values": list(results), "ops": args.ops, "bench_args": bench_args, "rows": summary},
        indent=2))
    first = next(iter(results))
    for field in FIELDS:
        if not any(field in row for row in summary):
            continue
        print(f"\n{field} (µs) by {args.key}: " + "  ".join(str(v) for v in results)
              + f"   (ratio to {args.key}={first})")
        for row in summary:
            cells = row.get(field, {})
            us = [f"{cells[v]:8.1f}" if v in cells else f"{'-':>8}" for v in results]
            ratios = [f"{cells[v] / cells[first]:5.2f}x" if v in cells and first in cells else f"{'-':>6}"
                      for v in results if v != first]
            print(f"  M={row['M']:5d} R={row['R']:3d} " + " ".join(us) + "   " + " ".join(ratios))
    return 0 if len(results) == len(args.values) else 1


def side_by_side(results: dict[int, dict[tuple[int, int], dict]]) -> list[dict]:
    """Per (M, R): each field of :data:`FIELDS` as ``{value: µs}`` over the values whose run has it."""
    rows = []
    for m, r in sorted(set().union(*(res.keys() for res in results.values()))):
        row = {"M": m, "R": r}
        for field in FIELDS:
            cells = {v: res[(m, r)][field] for v, res in results.items() if field in res.get((m, r), {})}
            if cells:
                row[field] = cells
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
