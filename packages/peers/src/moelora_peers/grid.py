"""The peers grid: every peer path through the layer suite and the e2e suite, one record per cell
(``nox -s peers``).

``python -m moelora_peers.grid run --out .reports --fixtures DIR`` runs, per path of :data:`PATHS`:

- the layer suite, ``moelora-conformance run`` (interpret profile, a small fixed example budget and
  Hypothesis seed, so a manifest entry names a deterministic cell) with the path's manifest
  (``packages/peers/manifests/<peer>-<version>-<path>.toml``);
- the e2e suite on the reference engine, ``moelora-conformance e2e`` CI-sized (:data:`E2E_ARGS`: the
  kernel backends' 16-request workload of the main job, every engine mode, the path's first declared
  dtype of :data:`E2E_DTYPES`, one fixture family, ``PeerPathSpec.e2e_family``) with the path's e2e manifest
  (``<peer>-<version>-<path>.e2e.toml``);

expected failures citing conformance/docs/peers.md. ``--suites layer`` (or ``e2e``) runs one of them;
``--smoke`` is the CI budget (the layer suite in the path's first dtype only). Then it writes:

- ``.reports/peers.json``: a header (the peers' versions and their own torch / transformers pins, the
  versions this run used, each path's CPU substitutes) and one record per cell: ``peer``, ``version``,
  ``path``, ``property``, ``mode``, ``dtype``, ``status`` (pass / fail / not_implemented / refused /
  not_run), ``expected`` (a manifest entry matched), ``reason``, ``replay`` (the line that reruns it),
  ``cpu_substitutes`` (what stood in for CUDA-only helpers in that cell), ``suite`` ("layer" or
  "e2e");
- ``.reports/peers-matrix.md``: the matrix (path × property, modes and dtypes folded) and the
  failures with their replay lines.

Exit status 1 when a cell fails unexpectedly, a manifest entry is stale (an XPASS) or a path is
refused (its factory cannot be built: the error is the reason of every cell of that path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
#: Statuses of a cell.
STATUSES = ("pass", "fail", "not_implemented", "refused", "not_run")
_STATUS = {"passed": "pass", "failed": "fail", "xfailed": "fail", "xpassed": "fail",
           "not_implemented": "not_implemented", "not_run": "not_run"}


@dataclass(frozen=True)
class PeerPathSpec:
    """One row of the grid: ``peer`` / ``path``, its ``--backend`` target; ``cpu_dtypes``: the layer
    suite's dtypes on a CPU (None: every dtype the path declares), a budget where the interpreter is
    slow, the other dtypes left to the GPU cells."""

    peer: str
    path: str
    target: str
    cpu_dtypes: str | None = None
    e2e_family: str = "qwen3_moe"


PATHS: tuple[PeerPathSpec, ...] = (
    PeerPathSpec("sglang", "legacy", "moelora_peers.sglang:legacy"),
    # F5 (conformance/docs/peers.md): the virtual-experts shrink cannot run H or I below 64 that are
    # not powers of two (qwen3_moe's H = 48; the layer suite's P12 keeps the finding): its e2e runs
    # on the fixture with H = 64, I = 32.
    PeerPathSpec("sglang", "virtual_experts", "moelora_peers.sglang:virtual_experts", e2e_family="qwen3_moe_h2i"),
    PeerPathSpec("sglang", "grouped", "moelora_peers.sglang:grouped"),
    # vLLM's dense shrink launches 64 split-K programs per slot (get_lora_op_configs' default below
    # 128 tokens): about 1.5 minutes a cell under the interpreter. fp16 here, bf16 on the GPU.
    PeerPathSpec("vllm", "fused", "moelora_peers.vllm:fused", cpu_dtypes="fp16"),
)


#: The e2e suite's CI-sized workload (the kernel backends' in the main job, noxfile.MAIN_CHECKS): 16
#: requests, prompts up to 56 tokens (past the largest prefill bucket, so E04 has a step beyond
#: capacity), E06's state machine off; every engine mode (the paths declare both graph families and
#: both prefill modes).
E2E_ARGS = ("--requests", "16", "--max-new-tokens", "4", "--max-prompt-tokens", "56", "--state-machine-examples", "0")
#: e2e dtype: the first of these the path declares (the layer suite runs every declared dtype).
E2E_DTYPES = (("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16"))
SUITES = ("layer", "e2e")


def manifest_path(peer: str, version: str, path: str, suite: str = "layer") -> Path:
    """The expected-failure manifest of one peer release's path for ``suite``."""
    return MANIFESTS / (f"{peer}-{version}-{path}.toml" if suite == "layer" else f"{peer}-{version}-{path}.e2e.toml")


def probe(spec: PeerPathSpec) -> dict:
    """Build the path's backend on a tiny spec (a fresh process: the finders are per process):
    {"version", "cpu_substitutes", "pins", "name"} or {"refused": error}."""
    code = f"""
import json, torch
from moelora_core.backend import load_backend
from moelora_core.layer_spec import LoRALayerSpec
spec = LoRALayerSpec(16, 16, 2, 1, {{}}, 1, 4)
b = load_backend({spec.target!r})(spec)
from moelora_peers import {spec.peer}_modules as m
d = m.importer().dist
dts = {{str(d).removeprefix("torch.") for d in b.capabilities().dtypes}}
print(json.dumps({{"name": b.name, "version": b.version, "cpu_substitutes": b.cpu_substitutes, "dtypes": sorted(dts),
                  "pins": d.pins("torch", "transformers", "triton"), "files": len(m.importer().loaded)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"refused": lines[-1] if lines else f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_dtype(info: dict) -> tuple[str, str]:
    """(short, torch name) of the first dtype of :data:`E2E_DTYPES` the path declares."""
    return next(d for d in E2E_DTYPES if d[1] in info.get("dtypes", ())) if info.get("dtypes") else E2E_DTYPES[0]


def run_path(spec: PeerPathSpec, info: dict, out: Path, max_examples: int, seed: int, workers: int,
             smoke: bool = False) -> Path:
    """``moelora-conformance run`` on one path; returns its JSON report's path."""
    report = out / f"peers-{spec.peer}-{spec.path}.json"
    cmd = ["moelora-conformance", "run", "--backend", spec.target, "--profile", "interpret",
           "--max-examples", str(max_examples), "-n", str(workers), "--json", str(report)]
    if smoke:
        cmd += ["--dtypes", first_dtype(info)[0]]
    elif spec.cpu_dtypes:
        cmd += ["--dtypes", spec.cpu_dtypes]
    manifest = manifest_path(spec.peer, info["version"], spec.path)
    if manifest.exists():
        cmd += ["--manifest", str(manifest)]
    cmd += ["--", "--no-shrink", f"--hypothesis-seed={seed}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    return report


def run_e2e(spec: PeerPathSpec, info: dict, out: Path, fixtures: str | None) -> Path:
    """``moelora-conformance e2e`` (CI-sized, :data:`E2E_ARGS`) on one path; returns its JSON report's path."""
    report = out / f"peers-e2e-{spec.peer}-{spec.path}.json"
    cmd = ["moelora-conformance", "e2e", "--backend", spec.target, "--families", spec.e2e_family, *E2E_ARGS,
           "--dtype", first_dtype(info)[1], "--json", str(report)]
    if fixtures:
        cmd += ["--fixtures", fixtures]
    manifest = manifest_path(spec.peer, info["version"], spec.path, "e2e")
    if manifest.exists():
        cmd += ["--manifest", str(manifest)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    return report


def _replay(record: dict, target: str, max_examples: int, seed: int) -> str:
    repro = record.get("repro") or {}
    if repro.get("rerun"):
        return repro["rerun"]
    if repro.get("replays") or repro.get("replay"):
        return (repro.get("replays") or [repro.get("replay")])[0]
    return (f"pytest -p moelora_conformance.plugin --backend {target} --device cpu -k '{record.get('test', '')}' "
            f"-p no:cacheprovider --profile interpret --max-examples {max_examples} --no-shrink "
            f"--hypothesis-seed={seed}")


def cells(spec: PeerPathSpec, info: dict, report: dict | None, max_examples: int, seed: int,
          suite: str = "layer") -> list[dict]:
    """One record per cell of a path and suite (module docstring)."""
    base = {"peer": spec.peer, "version": info.get("version"), "path": spec.path, "suite": suite}
    if "refused" in info or report is None:
        reason = info.get("refused") or f"the path's {suite} run wrote no report"
        return [{**base, "property": "*", "mode": "*", "dtype": "*", "status": "refused" if "refused" in info
                 else "not_run", "expected": False, "reason": reason, "replay": None, "cpu_substitutes": {}}]
    out = []
    subs = info.get("cpu_substitutes") or {}
    for rec in report["records"]:
        outcome = rec["outcome"]
        status = _STATUS.get(outcome, "not_run")
        mode = rec.get("mode", "")
        touched = {k: v for k, v in subs.items() if _touches(k, mode)}
        out.append({**base, "property": rec.get("property"), "mode": mode, "dtype": rec.get("dtype"),
                    "status": status, "expected": outcome == "xfailed", "stale": outcome == "xpassed",
                    "reason": rec.get("reason") or rec.get("message") or "",
                    "replay": _replay(rec, spec.target, max_examples, seed) if status == "fail" else None,
                    "cpu_substitutes": touched, "outcome": outcome})
    return out


def _touches(substitute: str, mode: str) -> bool:
    """Whether a CPU substitute named ``substitute`` ran in cells of ``mode`` (names that say "(eager)"
    or "(graph families)" touch those modes only)."""
    if "(eager)" in substitute:
        return mode == "eager"
    if "(graph families)" in substitute:
        return mode != "eager"
    return True


def matrix(records: list[dict]) -> str:
    """The Markdown matrix: one row per path, one column per property (worst status over modes and
    dtypes; ``xfail`` where every failure is expected), then the unexpected failures."""
    short = {"pass": "pass", "fail": "FAIL", "not_implemented": "n/i", "refused": "refused", "not_run": "not run"}
    rank = {"fail": 0, "refused": 1, "not_run": 2, "not_implemented": 3, "pass": 4}
    props = sorted({r["property"] for r in records if r["property"] != "*"})
    rows: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        rows[(r["peer"], r["version"], r["path"])][r["property"]].append(r)
    lines = ["| peer | version | path | " + " | ".join(props) + " |", "|---" * (3 + len(props)) + "|"]
    for (peer, version, path), by_prop in rows.items():
        if "*" in by_prop:
            lines.append(f"| {peer} | {version} | {path} | " + " | ".join(short[by_prop['*'][0]['status']]
                                                                          for _ in props) + " |")
            continue
        shown = []
        for p in props:
            recs = by_prop.get(p, [])
            if not recs:
                shown.append("–")
                continue
            worst = min(recs, key=lambda r: rank[r["status"]])
            cell = short[worst["status"]]
            if worst["status"] == "fail" and all(r["expected"] for r in recs if r["status"] == "fail"):
                cell = "xfail"
            if any(r["cpu_substitutes"] for r in recs if r["status"] in ("pass", "fail")):
                cell += "*"
            shown.append(cell)
        lines.append(f"| {peer} | {version} | {path} | " + " | ".join(shown) + " |")
    lines += ["", "`*`: the cell ran with a CPU substitute (see the records' `cpu_substitutes`); `xfail`: failures "
              "expected by the path's manifest (conformance/docs/peers.md analyses each).", ""]
    bad = [r for r in records if (r["status"] == "fail" and not r["expected"]) or r.get("stale")
           or r["status"] == "refused"]
    if bad:
        lines.append("## Unexpected\n")
        for r in bad:
            what = "stale manifest entry (XPASS)" if r.get("stale") else r["status"]
            lines.append(f"- {r['peer']} {r['path']} {r['property']} {r['mode']} {r['dtype']}: {what}: "
                         f"{r['reason'][:300]}")
            if r.get("replay"):
                lines.append(f"  - replay: `{r['replay']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moelora_peers.grid", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["run", "render"], help="run the grid, or render existing reports")
    ap.add_argument("--out", default=".reports", help="report folder")
    ap.add_argument("--max-examples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=20261206)
    ap.add_argument("-n", "--workers", type=int, default=2)
    ap.add_argument("--path", action="append", default=None, help="peer:path to run (repeatable; default all)")
    ap.add_argument("--suites", default=",".join(SUITES), help="comma-separated: layer, e2e (default both)")
    ap.add_argument("--fixtures", default=None, help="fixtures built by make-fixtures (e2e; default: built by e2e)")
    ap.add_argument("--smoke", action="store_true", help="CI budget: the layer suite in the path's first dtype only")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in PATHS if args.path is None or f"{p.peer}:{p.path}" in args.path]
    unknown = set(args.path or ()) - {f"{p.peer}:{p.path}" for p in PATHS}
    if unknown or set(args.suites.split(",")) - set(SUITES):
        ap.error(f"unknown --path {sorted(unknown)} or --suites {args.suites!r}")
    header = {"python": platform.python_version(), "environment": {k: v for k, v in os.environ.items()
                                                                  if k.startswith(("MOELORA_", "TRITON_"))},
              "max_examples": args.max_examples, "hypothesis_seed": args.seed, "smoke": args.smoke,
              "e2e": list(E2E_ARGS), "paths": {}}
    try:
        import torch
        import triton
        header["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    except ImportError:  # pragma: no cover
        header["versions"] = {}
    records: list[dict] = []
    for spec in chosen:
        info = probe(spec)
        header["paths"][f"{spec.peer}:{spec.path}"] = info
        suites = ["layer"] if args.smoke else args.suites.split(",")
        for suite in suites:
            report_path = out / (f"peers-{spec.peer}-{spec.path}.json" if suite == "layer"
                                 else f"peers-e2e-{spec.peer}-{spec.path}.json")
            if args.command == "run" and "refused" not in info:
                report_path.unlink(missing_ok=True)  # a run that writes nothing must not reuse an old report
                if suite == "layer":
                    run_path(spec, info, out, args.max_examples, args.seed, args.workers, smoke=args.smoke)
                else:
                    run_e2e(spec, info, out, args.fixtures)
            report = json.loads(report_path.read_text()) if report_path.exists() else None
            records += cells(spec, info, report, args.max_examples, args.seed, suite)
    (out / "peers.json").write_text(json.dumps({"header": header, "records": records}, indent=1))
    head = [f"# Peers grid ({', '.join(f'{k}: {v}' for k, v in header['versions'].items())}, "
            f"{args.max_examples} example(s) per item, Hypothesis seed {args.seed})", ""]
    for key, info in header["paths"].items():
        if "refused" in info:
            head.append(f"- {key}: refused: {info['refused']}")
        else:
            pins = ", ".join(info.get("pins", {}).values()) or "no torch pin"
            subs = "; ".join(f"{k} → {v}" for k, v in info.get("cpu_substitutes", {}).items()) or "none"
            head.append(f"- {key} {info['version']} (the release pins {pins}; ran on torch "
                        f"{header['versions'].get('torch')}): CPU substitutes: {subs}")
    (out / "peers-matrix.md").write_text("\n".join(head) + "\n\n" + matrix(records))
    counts = defaultdict(int)
    for r in records:
        counts[r["status"]] += 1
    print(f"peers grid: {dict(counts)}; reports: {out / 'peers.json'}, {out / 'peers-matrix.md'}")
    bad = [r for r in records if (r["status"] == "fail" and not r["expected"]) or r.get("stale")
           or r["status"] == "refused"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
