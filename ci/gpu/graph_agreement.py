"""CUDA graphs vs the graph emulator, program by program, on a CUDA machine (the H200).

Runs every program of ``packages/core/tests/graph_programs.py`` (faulty ones and their clean
twins, plus the semantics programs) twice on the GPU: captured with ``torch.cuda.CUDAGraph`` and
captured by the emulator on the same CUDA tensors. For each program and seed it checks

- agreement: both kinds fail capture with HostSyncError, or both replay and every replay
  output and every state tensor afterwards are equal element for element (bitwise, NaN = NaN);
- prediction: each kind behaves as the program predicts (clean = eager, faulty = the predicted
  faulty output, host syncs raise).

Prints a table and the versions, and exits non-zero on any disagreement or failed prediction.

    PYTHONPATH=packages/core/src python ci/gpu/graph_agreement.py [--seeds 3] [--out FILE]

Runs from source (no install needed besides torch; Triton programs run when Triton is installed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _record import ROOT, environment_line

for extra in (ROOT / "packages" / "core" / "src", ROOT / "packages" / "core" / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import graph_programs as gp  # noqa: E402
import torch  # noqa: E402

from moelora_core.graphs import GraphPool  # noqa: E402


def _outcome(run: gp.ProgramRun) -> str:
    return "HostSyncError" if run.error is not None else f"{len(run.replay)} replays"


def compare(prog: gp.Program, seed: int) -> tuple[gp.ProgramRun, gp.ProgramRun, list[str]]:
    """Run ``prog`` under both kinds on cuda; return both runs and the problems found."""
    cuda = gp.run_program(prog, "cuda", "cuda", seed)
    emulated = gp.run_program(prog, "cuda", "emulated", seed)
    problems = [f"[cuda] {p}" for p in gp.check_run(prog, cuda)]
    problems += [f"[emulated] {p}" for p in gp.check_run(prog, emulated)]
    if (cuda.error is None) != (emulated.error is None):
        problems.append(f"{prog.name}: cuda {_outcome(cuda)} vs emulated {_outcome(emulated)}")
        return cuda, emulated, problems
    for step, (a, b) in enumerate(zip(cuda.replay, emulated.replay)):
        if not gp.same(a, b):
            problems.append(f"{prog.name}: step {step}: CUDA graph and emulator replays differ")
    for name, value in cuda.state.items():
        if not gp.same(value, emulated.state.get(name)):
            problems.append(f"{prog.name}: state.{name} differs after the replays")
    return cuda, emulated, problems


def rng_sequence(kind: str, seed: int) -> list[torch.Tensor]:
    """Seed, capture a random program (no warm-up), replay twice, then draw eagerly: a CUDA
    capture draws nothing from the generator and each replay draws like an eager call."""
    torch.manual_seed(seed)
    x = torch.randn(6, device="cuda")

    def noisy() -> torch.Tensor:
        return x + torch.randn(6, device="cuda") * torch.rand(6, device="cuda")

    graph = GraphPool("decode", "cuda", kind=kind).capture(noisy, warmup=0)
    out = [graph.replay().clone(), graph.replay().clone(), noisy()]
    return [t.cpu() for t in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per program (default 3)")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--overhead", action="store_true",
                        help="also time eager vs CUDA graph vs emulated replay (graph_overhead.py)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_agreement: needs a CUDA device", file=sys.stderr)
        return 2
    lines = [f"graph agreement: CUDA graphs vs emulator ({environment_line()})", ""]
    lines.append(f"{'program':26} {'fault':18} {'cuda':14} {'emulated':14} {'seeds':>5}  result")
    all_problems: list[str] = []
    for prog in gp.PROGRAMS:
        if prog.needs_triton and not gp.triton_available():
            lines.append(f"{prog.name:26} {prog.fault or '-':18} {'skipped: no triton':>30}")
            continue
        problems: list[str] = []
        for seed in range(args.seeds):
            cuda, emulated, found = compare(prog, seed)
            problems += found
        all_problems += problems
        verdict = "agree, as predicted" if not problems else f"FAIL ({len(problems)})"
        lines.append(f"{prog.name:26} {prog.fault or '-':18} {_outcome(cuda):14} {_outcome(emulated):14} "
                     f"{args.seeds:>5}  {verdict}")
    rng_ok = all(gp.same(a, b) for a, b in zip(rng_sequence("cuda", 5), rng_sequence("emulated", 5)))
    lines += ["", f"generator after capture, across replays and the next eager draw: {'agree' if rng_ok else 'FAIL'}"]
    if not rng_ok:
        all_problems.append("rng_sequence: CUDA graph and emulator draw different random numbers")
    if args.overhead:
        import graph_overhead

        res = graph_overhead.measure("cuda", tokens=64)
        ops = int(res.pop("emulated ops"))
        lines.append(f"replay overhead, representative layer (64 tokens, {ops} ops), median µs per forward: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    lines.append("" if not all_problems else "problems:")
    lines += [f"  {p}" for p in all_problems]
    lines.append(f"graph_agreement: {'FAILED' if all_problems else 'OK'}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if all_problems else 0


if __name__ == "__main__":
    sys.exit(main())
