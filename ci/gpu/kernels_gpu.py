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
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["packages/core/src", "packages/kernels/src", "reference/src", "conformance/src"]


def _versions() -> dict[str, str]:
    import torch
    import triton

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": triton.__version__,
        "python": platform.python_version(),
    }


def _parse(output: str) -> dict:
    """Counts from pytest's summary line and Hypothesis' statistics."""
    summary = {}
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", output.splitlines()[-1]
                              if output.strip() else ""):
        summary[what] = int(n)
    examples = {}
    current = None
    for line in output.splitlines():
        m = re.match(r"^(\S+::\S+):$", line.strip())
        if m:
            current = m.group(1)
            continue
        m = re.search(r"- (\d+) passing, (\d+) failing, and (\d+) invalid", line)
        if m and current:
            examples[current] = {"passing": int(m.group(1)), "failing": int(m.group(2)), "invalid": int(m.group(3))}
    return {"summary": summary, "examples": examples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="gpu", help="moelora Hypothesis profile (gpu, dev, soak, ...)")
    parser.add_argument("--out", default="kernels_gpu.json", help="where to write the JSON record")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # real kernels, not the interpreter
    env["MOELORA_PROFILE"] = args.profile
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / p) for p in SOURCES] + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "packages/kernels/tests", "-p", "no:cacheprovider", "-q", "-rfEs",
           "--hypothesis-show-statistics", *args.pytest_args]
    print("running:", " ".join(cmd), f"(MOELORA_PROFILE={args.profile})", flush=True)
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    output = proc.stdout + proc.stderr
    print(output)
    record = {**_versions(), "profile": args.profile, "exit_code": proc.returncode, "wall_s": round(wall, 1),
              **_parse(proc.stdout)}
    Path(args.out).write_text(json.dumps(record, indent=2))
    total = sum(v["passing"] for v in record["examples"].values())
    print(f"kernels_gpu: exit {proc.returncode}, {record['summary']}, {total} Hypothesis examples over "
          f"{len(record['examples'])} property tests, {wall:.0f} s; record in {args.out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
