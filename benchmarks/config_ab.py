"""A/B of one kernel-config key: ``bench_moe_lora.py`` once per value, each on a copy of the shipped
table with the key set on every entry of the named operations (through ``MOELORA_KERNEL_CONFIGS``).

    PYTHONPATH=... python benchmarks/config_ab.py --out-dir OUT --key FLAT_GRID --values 0 1 \\
        --ops moe_lora_shrink moe_lora_expand fused_moe_lora -- --tokens 1 8 32 128 512 --no-baseline

Writes ``OUT/<key>_<value>.json`` (the benchmark's JSON) and ``.log`` per value, then prints, per
(M, R), the benchmark's ``b_us`` (and ``b_idle_us`` / ``ab_fused_us`` when present) of each value side
by side. Values run one after another in separate processes (the table is read once per process).
Only for a GPU host; the rows' ``err_*`` checks run inside the benchmark as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "packages/kernels/src/moelora_kernels/configs/h200.json"
#: Row fields compared side by side when present.
FIELDS = ("b_us", "b_idle_us", "b_fused_us", "b_unfused_us", "ab_fused_us")


def table_with(key: str, value: int, ops: list[str]) -> dict:
    """The shipped table with ``key = value`` on every entry of ``ops``.

    Raises:
        SystemExit: an op the table does not have (a typo would otherwise A/B nothing).
    """
    table = json.loads(TABLE.read_text())
    for op in ops:
        if op not in table:
            raise SystemExit(f"config_ab: {op!r} is not an operation of {TABLE.name}")
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
    args = parser.parse_args(own)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for value in args.values:
        cfg = out / f"table_{args.key}_{value}.json"
        cfg.write_text(json.dumps(table_with(args.key, value, args.ops)))
        stem = out / f"{args.key}_{value}"
        env = os.environ | {"MOELORA_KERNEL_CONFIGS": str(cfg)}
        cmd = [sys.executable, str(Path(__file__).parent / "bench_moe_lora.py"), "--out", f"{stem}.json", *bench_args]
        with open(f"{stem}.log", "w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{args.key}={value}: rc {rc}", flush=True)
        if rc == 0:
            results[value] = {(r["M"], r["R"]): r for r in json.loads(Path(f"{stem}.json").read_text())["rows"]}
    if not results:
        return 1
    keys = sorted(set().union(*(r.keys() for r in results.values())))
    for field in FIELDS:
        if not any(field in row for r in results.values() for row in r.values()):
            continue
        print(f"\n{field} (µs) by {args.key}: " + "  ".join(str(v) for v in results))
        for mr in keys:
            cells = [f"{results[v][mr][field]:8.1f}" if mr in results[v] and field in results[v][mr] else f"{'-':>8}"
                     for v in results]
            print(f"  M={mr[0]:5d} R={mr[1]:3d} " + " ".join(cells))
    return 0 if len(results) == len(args.values) else 1


if __name__ == "__main__":
    sys.exit(main())
