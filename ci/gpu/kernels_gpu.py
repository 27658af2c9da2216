"""The kernel suite on a CUDA machine (the H200), from source, and a record of the run.

Runs ``packages/kernels/tests`` with pytest on the GPU (no ``TRITON_INTERPRET``): every property
test in the chosen Hypothesis profile (``gpu`` by default: bf16 among the dtypes, Qwen3-30B-A3B layer
shapes among the shapes), every kernel launch under ``torch.cuda.set_sync_debug_mode("error")``,
the > 2^31-element offsets case and the CUDA-graph capture/replay test. Prints and writes a summary
(date, GPU, versions, pass/fail/skip counts, Hypothesis examples per property test).

    PYTHONPATH=packages/core/src:packages/kernels/src:reference/src:conformance/src \\
        python ci/gpu/kernels_gpu.py [--profile gpu] [--out kernels_gpu.json] [-- extra pytest args]

No install needed besides torch, triton, pytest and hypothesis; the script puts the source folders
on the path of the pytest it starts.
"""

from __future__ import annotations

import argparse
import sys

from _record import ROOT, environment, hypothesis_examples, pytest_summary, run_timed, source_env, write_record

SOURCES = ["packages/core/src", "packages/kernels/src", "reference/src", "conformance/src"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="gpu", help="moelora Hypothesis profile (gpu, dev, soak, ...)")
    parser.add_argument("--out", default="kernels_gpu.json", help="where to write the JSON record")
    parser.add_argument("--tests", action="append", default=None,
                        help="test files under packages/kernels/tests to run (repeatable; default: all)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="interrupt pytest after this many seconds (it still reports what ran)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()

    env = dict(source_env(SOURCES), MOELORA_PROFILE=args.profile)
    tests = [f"packages/kernels/tests/{t}" for t in args.tests] if args.tests else ["packages/kernels/tests"]
    # -v and --durations: a run cut short (budget, the matrix's timeout) still says which test ran how long
    cmd = [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-v", "-rfEs", "--durations=25",
           "--hypothesis-show-statistics", *args.pytest_args]
    proc, wall, _ = run_timed(cmd, cwd=ROOT, env=env, note=f"(MOELORA_PROFILE={args.profile})",
                              budget_s=args.budget_s, echo=True)
    # pytest stopped by --budget-s exits 2 (interrupted): report it as a timeout (exit 124, the
    # matrix's "timeout"), not as an error of the suite, since the cell did not fit its time
    cut = args.budget_s is not None and wall >= args.budget_s and proc.returncode == 2
    code = 124 if cut else proc.returncode
    record = {**environment(), "profile": args.profile, "exit_code": code, "interrupted_at_budget": cut,
              "wall_s": round(wall, 1),
              "summary": pytest_summary(proc.stdout), "examples": hypothesis_examples(proc.stdout)}
    write_record(args.out, record)
    total = sum(v["passing"] for v in record["examples"].values())
    how = " (cut at --budget-s)" if cut else ""
    print(f"kernels_gpu: exit {code}{how}, {record['summary']}, {total} Hypothesis examples over "
          f"{len(record['examples'])} property tests, {wall:.0f} s; record in {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
