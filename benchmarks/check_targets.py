"""Judge benchmark JSON against a card's kernel-speed targets (``benchmarks/targets-<card>.json``).

    python benchmarks/check_targets.py benchmarks/targets-h100.json RUN.json [RUN.json ...]

A ``bench_moe_lora.py`` JSON (rows with ``a_us`` / ``b_us`` per M and R) is held to the file's absolute
``lora_b_us`` [M][R] and ``base_a_us`` [M]; a ``bench_peers.py`` JSON (rows with ``path`` and ``unit``) to the
ratio rule inside its own run: moelora's b at most ``lora_ratio`` x the fastest peer path's b of the same (M,
R), moelora's a at most ``base_ratio`` x the fastest peer base's a. A cell is judged only when the run holds a
row of every path of ``lora_peer_paths`` / ``base_peer_paths`` at it (a run of one peer path would set an easy
target); a row a peer skipped or failed counts as present but sets no time. Each run must carry the card the
targets are for (its ``gpu`` field). Prints one line per cell (value, target, met or the factor missed) and
per run a verdict; exits 0 when every cell with a target in every run is met, 1 otherwise, 2 for unusable
input. Cells without a target are listed as "no target" and do not count; a run with no cell to judge is
unusable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _targets(path: Path) -> dict:
    t = json.loads(path.read_text())
    for key in ("card", "lora_ratio", "base_ratio", "lora_b_us", "base_a_us", "lora_peer_paths", "base_peer_paths"):
        if key not in t:
            raise ValueError(f"{path}: no {key!r}")
    return t


def judge_absolute(run: dict, t: dict) -> list[tuple[str, float, float | None]]:
    """(cell, value µs, target µs or None) for every base and LoRA cell of a ``bench_moe_lora.py`` run."""
    cells, seen = [], set()
    for r in run["rows"]:
        M, R = str(r["M"]), str(r["R"])
        if M not in seen and "a_us" in r:
            seen.add(M)
            cells.append((f"base a M={M}", r["a_us"], t["base_a_us"].get(M)))
        if "b_us" in r:
            cells.append((f"lora b M={M} R={R}", r["b_us"], t["lora_b_us"].get(M, {}).get(R)))
    return cells


def judge_ratio(run: dict, t: dict) -> list[tuple[str, float, float | None]]:
    """(cell, moelora's value µs, the ratio target in µs or None) for a ``bench_peers.py`` run."""
    best: dict[tuple, float] = {}
    mine: dict[tuple, float] = {}
    present: dict[tuple, set] = {}
    for r in run["rows"]:
        field = "b_us" if r.get("unit") == "lora" else "a_us"
        key = (r.get("unit"), r["M"], r.get("R"))
        present.setdefault(key, set()).add(r["path"])
        if field not in r:
            continue  # skipped or failed: present, not a measurement
        if r["path"] == "moelora":
            mine[key] = r[field]
        else:
            best[key] = min(best.get(key, float("inf")), r[field])
    cells = []
    for (unit, M, R), value in sorted(mine.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        peer = best.get((unit, M, R))
        ratio = t["lora_ratio"] if unit == "lora" else t["base_ratio"]
        name = f"lora b M={M} R={R}" if unit == "lora" else f"base a M={M}"
        wanted = set(t["lora_peer_paths"] if unit == "lora" else t["base_peer_paths"])
        if missing := sorted(wanted - present[(unit, M, R)]):
            name += f" (run lacks {', '.join(missing)})"
            peer = None
        cells.append((name, value, None if peer is None else ratio * peer))
    return cells


def check(targets_path: Path, runs: list[Path]) -> int:
    """Print the verdicts (module doc); returns the exit status."""
    t = _targets(targets_path)
    status = 0
    for path in runs:
        run = json.loads(path.read_text())
        gpu = run.get("gpu") or ""
        if t["card"] not in gpu:
            print(f"{path}: ran on {gpu or 'no GPU'!r}, not on the targets' card {t['card']!r}")
            return 2
        ratio = any("path" in r for r in run.get("rows", []))
        cells = (judge_ratio if ratio else judge_absolute)(run, t)
        judged = [c for c in cells if c[2] is not None]
        if not judged:
            print(f"{path}: no cell with a target")
            return 2
        missed = 0
        for name, value, target in cells:
            if target is None:
                verdict = "no target"
            elif value <= target:
                verdict = "met"
            else:
                verdict, missed = f"MISSED by {value / target:.2f}x", missed + 1
            print(f"{path.name}: {name:24} {value:9.1f} us  target {'-' if target is None else f'{target:.1f}':>8}  "
                  f"{verdict}")
        kind = "ratio rule, inside the run" if ratio else "absolute targets"
        print(f"{path.name}: {len(judged) - missed} of {len(judged)} cells met ({kind})")
        status = status or (1 if missed else 0)
    return status


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.split("\n\n")[1].strip())
        return 2
    try:
        return check(Path(args[0]), [Path(a) for a in args[1:]])
    except (OSError, ValueError, KeyError) as exc:
        print(f"check_targets: {type(exc).__name__}: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
