"""Judge benchmark JSON against a card's kernel-speed targets (``benchmarks/targets-<card>.json``).

    python benchmarks/check_targets.py benchmarks/targets-h100.json RUN.json [RUN.json ...]

A ``bench_moe_lora.py`` JSON (rows with ``a_us`` / ``b_us`` per M and R) is held to the file's absolute
``lora_b_us`` [M][R] and ``base_a_us`` [M]; a ``bench_peers.py`` JSON (rows with ``path`` and ``unit``) to the
ratio rule inside its own run: moelora's b at most ``lora_ratio`` x the fastest peer path's b of the same (M,
R), moelora's a at most ``base_ratio`` x the fastest peer base's a, judged only where the run holds a row of
every path of ``lora_peer_paths`` / ``base_peer_paths`` (a run of one peer path would set an easy target; a
row a peer skipped or failed counts as present but sets no time). A run meets its targets when every cell of
the grid (each (M, R) of ``lora_b_us`` and the base at each of its M) is in it, judged and met: a cell
missing, not judged, or whose moelora row holds no time is missed; duplicate rows are judged by their worst
time; cells outside the grid are judged where they have a target. Each run must come from the targets' card
(its ``gpu`` field, exactly). Where the run records the adapters' bytes (``b_weight_bytes``), a LoRA target below
their time at the run's plain-copy bandwidth is named as unreachable on the card (still a miss: the targets
file is what to change). Prints one line per cell and a verdict per run; exits 0 when every run meets its
targets, 1 otherwise, 2 for unusable input (not JSON, another card, a row without an int M, a time that is not
a finite positive number, nothing to judge).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _targets(path: Path) -> dict:
    t = json.loads(path.read_text())
    for key in ("card", "lora_ratio", "base_ratio", "lora_b_us", "base_a_us", "lora_peer_paths", "base_peer_paths"):
        if not isinstance(t, dict) or key not in t:
            raise ValueError(f"{path}: no {key!r}")
    return t


HERE = Path(__file__).resolve().parent


def for_card(gpu: str, folder: Path = HERE) -> tuple[Path, dict] | None:
    """The targets file in ``folder`` (``targets-*.json``) whose ``card`` is ``gpu`` exactly (as
    ``torch.cuda.get_device_name`` names it), with its contents; None for a card without one.

    Raises:
        ValueError: a targets file without a key the rule needs (named with the file).
    """
    for path in sorted(folder.glob("targets-*.json")):
        t = _targets(path)
        if t["card"] == gpu:
            return path, t
    return None


def cell_targets(t: dict | None, M: int, R: int) -> tuple[float | None, float | None]:
    """(base a, LoRA b) targets in µs of one (M, R) cell of targets ``t`` (None where it sets none)."""
    if t is None:
        return None, None
    return t["base_a_us"].get(str(M)), t["lora_b_us"].get(str(M), {}).get(str(R))


def _time(row: dict, field: str, where: str) -> float | None:
    """The row's time in µs, None when the row holds none (skipped or failed).

    Raises:
        ValueError: a time that is not a finite positive number (a broken measurement judges nothing).
    """
    if field not in row:
        return None
    v = row[field]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: {field} = {v!r} is not a finite positive time")
    return float(v)


def _rows(run, path: Path) -> list[dict]:
    """The run's rows, each a dict with an int ``M`` and an int or null ``R``.

    Raises:
        ValueError: anything else (named with the row's index).
    """
    rows = run.get("rows") if isinstance(run, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no list of rows")
    for i, r in enumerate(rows):
        ok = isinstance(r, dict) and type(r.get("M")) is int and (r.get("R") is None or type(r.get("R")) is int)
        if not ok:
            raise ValueError(f"{path}: row {i} is not a benchmark row with an int M and an int or null R: {r!r}")
    return rows


def _grid(t: dict) -> list[tuple[str, int, int | None]]:
    """Every cell a run must hold: the LoRA grid's (M, R) and the base at each of its M."""
    lora = [("lora", int(M), int(R)) for M, by_r in t["lora_b_us"].items() for R in by_r]
    return sorted({("base", M, None) for _, M, _ in lora}) + sorted(lora)


#: One cell: (moelora's times, None for a row without one; the target µs or None; why it has none).
Cell = tuple[list, float | None, str]


def _absolute(rows: list[dict], t: dict, where: str) -> dict[tuple, Cell]:
    """cell → :data:`Cell` of a ``bench_moe_lora.py`` run."""
    cells: dict[tuple, Cell] = {}
    for i, r in enumerate(rows):
        M, R = r["M"], r["R"]
        for unit, field, key, target in (("base", "a_us", (M, None), t["base_a_us"].get(str(M))),
                                         ("lora", "b_us", (M, R), t["lora_b_us"].get(str(M), {}).get(str(R)))):
            if field in r:
                cells.setdefault((unit, *key), ([], target, "no target"))[0].append(_time(r, field, f"{where} row {i}"))
    return cells


def _ratio(rows: list[dict], t: dict, where: str) -> dict[tuple, Cell]:
    """cell → :data:`Cell` of a ``bench_peers.py`` run, its target by the ratio rule: a cell is judged only
    when the run holds a row of every peer path of its unit."""
    mine: dict[tuple, list] = {}
    best: dict[tuple, float] = {}
    present: dict[tuple, set] = {}
    for i, r in enumerate(rows):
        unit = r.get("unit")
        if unit not in ("lora", "base") or not isinstance(r.get("path"), str):
            raise ValueError(f"{where} row {i}: no unit ('lora' or 'base') and path")
        key = (unit, r["M"], r["R"] if unit == "lora" else None)
        value = _time(r, "b_us" if unit == "lora" else "a_us", f"{where} row {i}")
        present.setdefault(key, set()).add(r["path"])
        if r["path"] == "moelora":
            mine.setdefault(key, []).append(value)
        elif value is not None:
            best[key] = min(best.get(key, math.inf), value)
    cells = {}
    for key, values in mine.items():
        unit = key[0]
        wanted = set(t["lora_peer_paths"] if unit == "lora" else t["base_peer_paths"])
        judged = key in best and wanted <= present[key]
        ratio = t["lora_ratio"] if unit == "lora" else t["base_ratio"]
        lacks = f"run lacks {', '.join(sorted(wanted - present[key])) or 'a peer time'}"
        cells[key] = (values, ratio * best[key], "") if judged else (values, None, lacks)
    return cells


def _weight_floors(run: dict, rows: list[dict]) -> dict[tuple, float]:
    """(M, R) → µs the run's adapter bytes take at its plain-copy bandwidth (``b_weight_bytes`` /
    ``copy_plain.GBps``, ``bench_moe_lora.py``): no kernel that reads the adapters from HBM beats it. Empty
    for a run without those fields (older runs, ``bench_peers.py``)."""
    gbps = (run.get("copy_plain") or {}).get("GBps") if isinstance(run.get("copy_plain"), dict) else None
    if not isinstance(gbps, (int, float)) or not math.isfinite(gbps) or gbps <= 0:
        return {}
    return {(r["M"], r["R"]): r["b_weight_bytes"] / gbps / 1e3 for r in rows
            if isinstance(r.get("b_weight_bytes"), int) and r["b_weight_bytes"] > 0}


def check(targets_path: Path, runs: list[Path]) -> int:
    """Print the verdicts (module doc); returns the exit status."""
    t = _targets(targets_path)
    status = 0
    for path in runs:
        run = json.loads(path.read_text())
        rows = _rows(run, path)
        if run.get("gpu") != t["card"]:
            print(f"{path}: ran on {run.get('gpu') or 'no GPU'!r}, not on the targets' card {t['card']!r}")
            return 2
        ratio = any("path" in r for r in rows)
        cells = (_ratio if ratio else _absolute)(rows, t, path.name)
        if not any(c[1] is not None for c in cells.values()):
            print(f"{path}: no cell with a target")
            return 2
        missed = met = unreachable = 0
        floors = _weight_floors(run, rows)
        grid = _grid(t)
        for key in grid + sorted(set(cells) - set(grid), key=lambda k: (k[0], k[1], k[2] or 0)):
            unit, M, R = key
            name = f"lora b M={M} R={R}" if unit == "lora" else f"base a M={M}"
            values, target, why = cells.get(key, ([], None, "not in the run"))
            times = [v for v in values if v is not None]
            worst = max(times) if times else None
            if key not in cells:  # only grid cells are listed without a row
                verdict = "MISSED: not in the run"
            elif None in values:
                verdict = "MISSED: moelora's row holds no time (failed or skipped)"
            elif target is None and key in grid:  # "done" needs every cell of the grid judged
                verdict = f"MISSED: not judged ({why})"
            elif target is None:
                verdict = f"no target ({why})"
            elif worst <= target:
                verdict = "met"
            else:
                verdict = f"MISSED by {worst / target:.2f}x"
            floor = floors.get((M, R)) if unit == "lora" else None
            if floor is not None and target is not None and target < floor:
                unreachable += 1
                verdict += f" (target below the adapters' weight floor, {floor:.1f} us at this run's copy)"
            if verdict.startswith("MISSED"):
                missed += 1
            elif verdict == "met":
                met += 1
            shown = "-" if worst is None else f"{worst:.1f}"
            print(f"{path.name}: {name:20} {shown:>9} us  target {'-' if target is None else f'{target:.1f}':>8}  "
                  f"{verdict}")
        kind = "ratio rule, inside the run" if ratio else "absolute targets"
        print(f"{path.name}: {met} of {met + missed} cells met ({kind}; the worst of duplicate rows)")
        if unreachable:
            print(f"{path.name}: {unreachable} cells' targets lie below the bytes of the adapters they read, at this "
                  "run's plain-copy bandwidth: no kernel reading them from HBM meets those")
        status = status or (1 if missed else 0)
    return status


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.split("\n\n")[1].strip())
        return 2
    try:
        return check(Path(args[0]), [Path(a) for a in args[1:]])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"check_targets: {type(exc).__name__}: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
