"""The GPU matrix runner: every GPU suite and the benchmark, from source, in stages that each fit
one device call (10 minutes), ending with one short table.

Stages (run in this order by default; pick with ``--stage``):

==============  ==========================================================  ==========
stage           what                                                        ~minutes
==============  ==========================================================  ==========
graphs          CUDA graphs vs the CPU-graph emulator (ci/gpu/graph_agreement.py)   1
kernels         kernel suite, gpu profile, sync debug "error" (ci/gpu/kernels_gpu.py)  6–8
reference       conformance suite on ``reference``, --device cuda, gpu profile           3–5
backends        conformance suite on ``triton`` and ``csgmv``, gpu profile (backends_gpu.py)  9
bench           MoE-LoRA benchmark (benchmarks/bench_moe_lora.py)                          1–2
runner-graphs   engine graph runners vs eager: real CUDA graphs, bf16, guard "error"     5–8
                (packages/runner/tests/test_graph_*.py; measurements in graph_vs_eager.jsonl)
bench-engine    engine benchmark: eager vs decode graph / prefill full / breakable          4–6
                (benchmarks/bench_engine.py; builds its 4-layer Qwen3-30B-A3B-shaped model)
tp-ep           TP = 2 / EP = 2 with NCCL + real CUDA graphs vs TP = 1 (ci/gpu/run_tp.sh;     ?
                needs 2 GPUs, prints SKIPPED otherwise; not in the default order)
==============  ==========================================================  ==========

    python ci/gpu/run_all.py --stage graphs --stage kernels --out-dir "$OUT"
    python ci/gpu/run_all.py --stage backends --out-dir "$OUT"

Every stage writes its own record (JSON / text / JUnit) under ``--out-dir``; this script prints one
row per stage (exit code, seconds, where the record is) and exits non-zero if any stage failed.
Needs torch, triton, pytest, hypothesis, rich (all on the H200 image); no nox, no install: the source
folders are put on PYTHONPATH for every stage.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["packages/core/src", "packages/kernels/src", "packages/backends/src", "packages/runner/src", "reference/src",
           "conformance/src"]
#: The engine's graph tests, run on CUDA in bf16 by the runner-graphs stage.
RUNNER_GRAPH_TESTS = [f"packages/runner/tests/test_graph_{name}.py"
                      for name in ("equivalence", "state", "capture", "fallback", "properties")]


def _stages(out: Path, examples: int) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "graphs": [py, "ci/gpu/graph_agreement.py", "--seeds", "3", "--overhead", "--out", str(out / "graphs.txt")],
        "kernels": [py, "ci/gpu/kernels_gpu.py", "--profile", "gpu", "--out", str(out / "kernels_gpu.json")],
        "reference": [py, "-m", "pytest", "-p", "moelora_conformance.plugin", "--backend", "reference",
                      "--device", "cuda", "--profile", "gpu", "--max-examples", str(examples),
                      "--report-json", str(out / "reference_gpu.json"), "--junitxml", str(out / "reference_gpu.xml"),
                      "-q"],
        "backends": [py, "ci/gpu/backends_gpu.py", "--max-examples", str(examples), "--budget-s", "270",
                     "--out-dir", str(out / "backends")],
        "bench": [py, "benchmarks/bench_moe_lora.py", "--out", str(out / "bench.json")],
        "runner-graphs": [py, "-m", "pytest", *RUNNER_GRAPH_TESTS, "-q", "-p", "no:cacheprovider",
                          "--junitxml", str(out / "runner_graphs.xml")],
        "bench-engine": [py, "benchmarks/bench_engine.py", "--out", str(out / "bench_engine.json")],
        "tp-ep": ["bash", "ci/gpu/run_tp.sh", str(out / "tp_ep")],
    }


def _stage_env(name: str, env: dict[str, str], out: Path, examples: int) -> dict[str, str]:
    """The environment of one stage (the common one plus what the stage needs)."""
    if name == "kernels":
        return dict(env, MOELORA_MAX_EXAMPLES=str(4 * examples))
    if name == "runner-graphs":
        return dict(env, MOELORA_RUNNER_DEVICE="cuda", MOELORA_RUNNER_DTYPE="bfloat16", MOELORA_PROFILE="gpu",
                    MOELORA_MAX_EXAMPLES=str(examples), MOELORA_GPU_OUT=str(out))
    if name == "tp-ep":
        return dict(env, PYTHON=sys.executable)  # run_tp.sh's interpreter: this one
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", action="append",
                        choices=["graphs", "kernels", "reference", "backends", "bench", "runner-graphs",
                                 "bench-engine", "tp-ep"],
                        help="stages to run (repeatable; default: all but tp-ep, in order)")
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "gpu_run")))
    parser.add_argument("--max-examples", type=int, default=5,
                        help="examples per conformance property item (kernel property tests get 4x)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / s) for s in SOURCES), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # real kernels on the GPU
    stages = _stages(args.out_dir, args.max_examples)
    rows = []
    for name in args.stage or [n for n in stages if n != "tp-ep"]:  # tp-ep needs a two-GPU machine
        start = time.monotonic()
        with open(args.out_dir / f"{name}.log", "w") as log:
            print(f"== {name}: {' '.join(stages[name])}", flush=True)
            stage_env = _stage_env(name, env, args.out_dir, args.max_examples)
            rc = subprocess.run(stages[name], cwd=ROOT, env=stage_env, stdout=log, stderr=subprocess.STDOUT).returncode
        rows.append((name, rc, time.monotonic() - start))
        tail = (args.out_dir / f"{name}.log").read_text().splitlines()[-15:]
        print("\n".join(tail), flush=True)
    print(f"\n{'stage':<10} {'exit':>4} {'seconds':>8}  log")
    for name, rc, secs in rows:
        print(f"{name:<10} {rc:>4} {secs:>8.1f}  {args.out_dir / (name + '.log')}")
    return 0 if all(rc == 0 for _, rc, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
