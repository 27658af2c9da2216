"""``moelora-conformance checkpoint-pass``: the real-checkpoint pass from the command line.

    moelora-conformance checkpoint-pass [--fixtures DIR | --model DIR --adapter NAME=DIR ...]
        [--backends reference,triton,csgmv]
        [--models a,b] [--skip-models c,d] [--modes eager,decode,prefill-full,prefill-breakable] [--layers 0,1]
        [--requests 40] [--work-dir DIR] [--json rows.json] [--require-coverage]

Builds the fixtures into a temporary directory unless ``--fixtures`` names one, builds the pass's
own adapters into ``--work-dir`` (default: a temporary directory) — or, with ``--model`` and
``--adapter NAME=DIR``, runs on your checkpoint and adapters (``user_files``: what each adapter must
mean read from its files; legacy per-expert + rsLoRA left out, peft serves another σ) —, runs :mod:`.run`, prints the
table and exits 1 on any failed comparison (with ``--require-coverage`` also on a cell whose adapters are
all no-ops: "not meaningful"), 2 on a usage error (a missing ``fixtures`` extra, a backend that cannot run
here — the Triton backends on a CPU need ``TRITON_INTERPRET=1``). No-op adapters are named at load.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from moelora_conformance.commands import (
    Handler,
    fixtures_or_exit,
    require_fixtures_extra,
    subcommand,
    user_files_or_exit,
)

_MODES = "eager,decode,prefill-full,prefill-breakable"


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _usable(backends: list[str]) -> str | None:
    """Why a backend cannot run the pass here (None = all can)."""
    import torch

    from moelora_core import InvalidFieldError, LoRALayerSpec, load_backend

    spec = LoRALayerSpec(hidden_size=8, moe_intermediate_size=8, num_experts=2, top_k=1, dense_shapes={},
                         max_loras=1, max_rank=1)
    for name in backends:
        try:
            caps = load_backend(name)(spec).capabilities()
        except InvalidFieldError as exc:
            return str(exc)
        missing = [f for f in ("decode", "prefill") if f not in caps.graph_families]
        if "cpu" not in caps.devices or torch.float32 not in caps.dtypes or missing:
            return (f"backend {name!r} cannot run the pass on the CPU in fp32 with both graph families "
                    f"(declares {caps.as_dict()}); Triton backends need TRITON_INTERPRET=1 on a CPU")
    return None


@subcommand("checkpoint-pass", help="every backend x layer mode on real checkpoints and PEFT adapters, against the "
                                    "oracle and HF+PEFT (needs the 'fixtures' extra)")
def _checkpoint_pass(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="a directory built by make-fixtures (default: build into a temporary directory)")
    parser.add_argument("--model", type=Path, default=None,
                        help="your own Hugging Face MoE checkpoint directory (instead of the fixtures)")
    parser.add_argument("--adapter", action="append", default=None, metavar="NAME=DIR",
                        help="with --model: one of your PEFT adapters (repeatable; at least one)")
    parser.add_argument("--backends", default="reference,triton,csgmv", help="comma-separated backends")
    parser.add_argument("--models", default=None, help="comma-separated fixture models (default: all)")
    parser.add_argument("--skip-models", default=None, help="comma-separated fixture models left out")
    parser.add_argument("--modes", default=_MODES, help=f"comma-separated layer modes (default: {_MODES})")
    parser.add_argument("--layers", default=None, help="comma-separated decoder layers (default: all)")
    parser.add_argument("--requests", type=int, default=None, help="requests per batch (default: 40)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the pass's own adapters are built")
    parser.add_argument("--json", type=Path, default=None, help="also write every comparison as JSON")
    parser.add_argument("--require-coverage", action="store_true",
                        help="a cell not proven (only no-op adapters compared: not meaningful) fails the run (exit 1)")

    def run(args: argparse.Namespace) -> int:
        if not require_fixtures_extra("checkpoint-pass"):
            return 2
        backends = _csv(args.backends) or []
        problem = _usable(backends)
        if problem:
            print(f"moelora-conformance checkpoint-pass: {problem}", file=sys.stderr)
            return 2
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from moelora_conformance.checkpoint_pass.batches import PASS_REQUESTS
        from moelora_conformance.checkpoint_pass.run import run_checkpoint_pass, run_model, user_pass_adapters
        from moelora_conformance.checkpoint_pass.table import render
        from moelora_conformance.fixtures import build_fixtures

        layers = None if args.layers is None else [int(v) for v in _csv(args.layers)]
        # one live line on a terminal; redirected output gets only its final state, not one line per run
        progress = Progress(SpinnerColumn(), TextColumn("checkpoint-pass: {task.completed} runs · {task.description}"),
                            TimeElapsedColumn())
        task = progress.add_task("starting", total=None)

        def advance(line: str) -> None:
            progress.update(task, advance=1, description=line)

        user = user_files_or_exit(args, "checkpoint-pass")
        if user is False:
            return 2
        given = fixtures_or_exit(args.fixtures, "checkpoint-pass") if args.fixtures else user
        if args.fixtures and given is None:
            return 2
        if user is not None:
            adapters, skipped = user_pass_adapters(user)
            if skipped:
                print(f"moelora-conformance checkpoint-pass: not compared with HF + PEFT: {skipped} (legacy per-expert "
                      "+ rsLoRA: peft serves another σ; run hf-check for them)", file=sys.stderr)
            if not adapters:
                print("moelora-conformance checkpoint-pass: no adapter left to compare", file=sys.stderr)
                return 2
        with tempfile.TemporaryDirectory(prefix="moelora-pass-") as tmp, progress:
            fixtures = given or build_fixtures(Path(tmp) / "fixtures")
            work = args.work_dir or Path(tmp) / "work"
            try:
                if user is not None:
                    (model,) = user.manifest["models"]
                    rows = run_model(user, work, model, backends=backends, modes=tuple(_csv(args.modes) or ()),
                                     layers=layers, num_requests=args.requests or PASS_REQUESTS, progress=advance,
                                     adapters=adapters)
                else:
                    rows = run_checkpoint_pass(fixtures, work, models=_csv(args.models),
                                               skip_models=_csv(args.skip_models) or (), backends=backends,
                                               modes=tuple(_csv(args.modes) or ()), layers=layers,
                                               num_requests=args.requests or PASS_REQUESTS,
                                               progress=advance)
            except ValueError as exc:
                print(f"moelora-conformance checkpoint-pass: {exc}", file=sys.stderr)
                return 2
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
        from moelora_conformance.user_files import noop_adapters

        noop = noop_adapters(user) if user is not None else {}
        return 0 if render(rows, noop=noop, require_coverage=args.require_coverage) else 1

    return run
