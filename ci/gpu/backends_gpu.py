"""The conformance suite over the ``triton`` and ``csgmv`` backends on a CUDA machine (the H200), from
source, and a record of the run.

For each backend, runs ``pytest -p moelora_conformance.plugin --backend <name> --device cuda`` in the
``gpu`` profile (bf16 among the dtypes, Qwen3-30B-A3B layer shapes among the shapes): graph modes on
real CUDA graphs (``torch.cuda.CUDAGraph`` through the graph API), P08 with
``torch.cuda.set_sync_debug_mode("error")`` around prepare + forward and a capture that fails on any
host sync. Prints and writes a summary per backend — date, GPU, versions, pass/fail/skip counts,
Hypothesis examples per property item (from ``--hypothesis-show-statistics``), wall time — and the
support matrix of both JSON reports.

    PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:reference/src:conformance/src \\
        python ci/gpu/backends_gpu.py [--max-examples 10] [--backend triton --backend csgmv] \\
        [--out-dir backends_gpu] [-- extra pytest args]

No install needed besides torch, triton, pytest, hypothesis and rich; the script puts the source
folders on the path of the pytest it starts. Exit status: non-zero if any backend's run failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from _record import environment, hypothesis_examples, run_timed, source_env, write_record

SOURCES = ["packages/core/src", "packages/kernels/src", "packages/backends/src", "reference/src", "conformance/src"]


def run_backend(backend: str, args: argparse.Namespace, env: dict[str, str], out_dir: Path) -> dict:
    report = out_dir / f"{backend}.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "moelora_conformance.plugin", "-p", "no:cacheprovider",
           "--backend", backend, "--device", "cuda", "--profile", args.profile, "--report-json", str(report),
           "--hypothesis-show-statistics", "-v", "-rfE", "--durations=15"]
    if args.max_examples:
        cmd += ["--max-examples", str(args.max_examples)]
    cmd += args.pytest_args
    # streamed to the log as it runs: a run stopped by the device's 10-minute call limit still
    # leaves every finished item in the log (2026-11-29: a buffered run printed nothing)
    proc, wall, output = run_timed(cmd, cwd=out_dir, env=env, log=out_dir / f"{backend}.log",
                                   budget_s=args.budget_s or None)
    print(output[-20000:])
    # Hypothesis' example directory is not a result; the device returns at most 8 files
    shutil.rmtree(out_dir / ".hypothesis", ignore_errors=True)
    summary = json.loads(report.read_text())["summary"] if report.is_file() else {}
    examples = hypothesis_examples(proc.stdout)
    return {"backend": backend, "exit_code": proc.returncode, "wall_s": round(wall, 1), "summary": summary,
            "examples_total": sum(v["passing"] for v in examples.values()), "examples": examples,
            "report": str(report)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", default=None, help="backends (default: triton and csgmv)")
    parser.add_argument("--profile", default="gpu", help="moelora profile (default gpu)")
    parser.add_argument("--max-examples", type=int, default=10,
                        help="examples per property item (default 10; 0 = the profile's 100)")
    parser.add_argument("--budget-s", type=float, default=0,
                        help="seconds per backend after which pytest is interrupted (it still writes its reports); "
                             "0 = none. Size it so all backends fit one device call")
    parser.add_argument("--out-dir", type=Path, default=Path("backends_gpu"), help="reports, logs and the record")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("backends_gpu: no CUDA device", file=sys.stderr)
        return 2
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = source_env(SOURCES)
    record = {**environment(), "profile": args.profile, "max_examples": args.max_examples or None, "runs": []}
    for backend in args.backend or ["triton", "csgmv"]:
        record["runs"].append(run_backend(backend, args, env, out_dir))
    write_record(out_dir / "backends_gpu.json", record)
    reports = [r["report"] for r in record["runs"] if Path(r["report"]).is_file()]
    if reports:
        matrix = subprocess.run([sys.executable, "-m", "moelora_conformance", "report", *reports], env=env,
                                capture_output=True, text=True)
        print(matrix.stdout or matrix.stderr)
        (out_dir / "matrix.md").write_text(matrix.stdout)
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}))
    for r in record["runs"]:
        print(f"backends_gpu: {r['backend']}: exit {r['exit_code']}, {r['summary']}, {r['examples_total']} "
              f"Hypothesis examples over {len(r['examples'])} property items, {r['wall_s']:.0f} s")
    print(f"record in {out_dir / 'backends_gpu.json'}")
    return max(r["exit_code"] for r in record["runs"])


if __name__ == "__main__":
    sys.exit(main())
