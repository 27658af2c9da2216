"""The ``moelora`` command.

    moelora generate --model DIR [--adapter NAME=DIR ...] --requests FILE.jsonl --output results.jsonl
                     [--backend reference|triton|csgmv|module:factory] [--dtype auto|float32|float16|bfloat16]
                     [--device cpu|cuda] [--max-loras N] [--max-lora-rank R] [--max-loras-per-batch N]
                     [--max-num-batched-tokens N] [--kv-cache-tokens N] [--moe-impl torch|triton]
                     [--graph eager|full|breakable] [--decode-graph | --no-decode-graph]
                     [--max-num-requests N] [--prefill-token-buckets 16,32,...] [--decode-batch-buckets 1,2,...]
                     [--metrics-file PATH] [--metrics-port PORT] [--no-progress] [--tp N] [--ep N]
    moelora make-fixtures DIR      # tiny local HF MoE models + PEFT adapters to try it on

``generate`` reads and validates every ``--adapter`` against the model before any request runs (slots
are filled on demand), serves the requests, and writes one output line per request, in input order.
Exit status: 0 when every request finished, 1 when any request failed (the others are still written),
2 on a usage error — bad arguments, an unreadable request file or checkpoint, a ``request_id`` used twice,
an adapter refused at start-up (its error class and message on stderr) — where nothing is served and no
output is written, 130 after Ctrl-C: the requests that had finished are written (in input order; the
file is rewritten, so an earlier run's results never remain; stopped before any request ran, even while
importing torch, an existing file is emptied), one line says so, no traceback. A request
whose ``max_new_tokens`` the model's context cut carries ``warnings`` in its output line and a line on
stderr. A no-op adapter (peft's default ``init_lora_weights=True`` saves lora_B = 0) is served, with a
warning on stderr at load (``moelora: warning: adapter 'x' is a no-op: ...``; the rule is
``moelora_core.checkpoint.adapter_effect``), as are the reader's notes on a config.

``--tp N`` / ``--ep N`` (:mod:`moelora_runner.parallel`): started as a plain command, ``generate``
checks the layout against the model's config (a refusal exits 2 before any worker starts), then
spawns ``max(tp, ep)`` workers with ``torch.multiprocessing`` (gloo on a CPU, NCCL and one GPU per
rank on CUDA); under torchrun (``RANK`` / ``WORLD_SIZE`` set) it uses the launcher's ranks, which
must number ``max(tp, ep)``. Every rank serves the same requests; rank 0 alone prints, writes
``--output`` and the metrics file and serves ``--metrics-port``; the exit status is rank 0's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

# Nothing here imports torch at module level: ``main`` (the console script) imports the engine, torch
# and the parser's choices inside its Ctrl-C guard (test_ctrl_c_while_importing_torch_is_one_line_and_130).

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2
#: Exit status after Ctrl-C (128 + SIGINT, as a shell reports a command killed by it).
EXIT_INTERRUPTED = 130


def _adapter(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, path


def _parser() -> argparse.ArgumentParser:
    from moelora_core.layer_spec import EXPERT_LAYOUTS
    from moelora_runner.graph_config import PREFILL_MODES
    from moelora_runner.moe_paths import MOE_IMPLS

    parser = argparse.ArgumentParser(prog="moelora", description="moelora's reference multi-LoRA MoE engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="serve a JSONL file of requests on a checkpoint with PEFT adapters")
    g.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    g.add_argument("--adapter", action="append", default=[], type=_adapter, metavar="NAME=DIR",
                   help="a PEFT LoRA adapter, served under NAME (repeatable)")
    g.add_argument("--requests", required=True, type=Path, help="JSONL, one request per line")
    g.add_argument("--output", required=True, type=Path, help="JSONL results, one line per request, input order")
    g.add_argument("--backend", default="reference", help="reference, triton, csgmv or module:factory")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--max-loras", type=int, default=4, help="adapter slots (default 4)")
    g.add_argument("--max-lora-rank", type=int, default=64, help="the pool's max rank R (default 64)")
    g.add_argument("--max-loras-per-batch", type=int, default=None, help="distinct adapters per batch "
                   "(default: --max-loras)")
    g.add_argument("--expert-layout", choices=list(EXPERT_LAYOUTS), default="per_expert",
                   help="which expert factors each adapter slot stores once (shared_outer, fully_shared: "
                        "adapters exported with shared factors, conformance/docs/checkpoints.md; default "
                        "per_expert, where any adapter fits and a shared factor is broadcast)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget (default 2048)")
    g.add_argument("--kv-cache-tokens", type=int, default=8192, help="KV cache size in tokens (default 8192)")
    g.add_argument("--moe-impl", choices=list(MOE_IMPLS), default=None,
                   help="base MoE path (default: torch on the CPU, triton on CUDA)")
    g.add_argument("--graph", choices=list(PREFILL_MODES), default=None,
                   help="prefill mode: eager, full (whole extend forward captured per token bucket) or breakable "
                   "(segments between attention calls captured); default: full on CUDA, eager on the CPU")
    g.add_argument("--decode-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the decode forward per batch-size bucket (default: on on CUDA, off on the CPU)")
    g.add_argument("--max-num-requests", type=int, default=None, help="request slots of the prefill graph "
                   "(default 64)")
    g.add_argument("--prefill-token-buckets", default=None, metavar="16,32,...",
                   help="prefill graph token buckets (default: 16, 32, ... doubling up to --max-num-batched-tokens)")
    g.add_argument("--decode-batch-buckets", default=None, metavar="1,2,...",
                   help="decode graph batch-size buckets (default: 1, 2, 4, 8, 16, 24, 32, then steps of 16 up to "
                   "256)")
    g.add_argument("--metrics-file", type=Path, default=None, help="write the Prometheus text exposition here")
    g.add_argument("--metrics-port", type=int, default=None, help="serve the metrics over HTTP on this port")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size: attention heads and (without --ep) "
                   "the MoE intermediate split over N ranks (default 1)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size: experts partitioned over N ranks "
                   "(with --tp: over the TP group's ranks, so 1 or equal to --tp; default 1)")
    f = sub.add_parser("make-fixtures", help="build tiny local HF MoE models and PEFT adapters (needs "
                       "moelora-conformance with its fixtures extra)")
    f.add_argument("directory", type=Path)
    return parser


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_USAGE


def _read_requests(path: Path) -> list[dict] | str:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        return f"moelora: cannot read --requests {path}: {exc}"
    requests, lines_of_id = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"moelora: {path} line {number}: not valid JSON: {exc}"
        if not isinstance(value, dict):
            return f"moelora: {path} line {number}: a request must be a JSON object, got {type(value).__name__}"
        rid = value.get("request_id")
        if isinstance(rid, str) and rid in lines_of_id:
            return (f"moelora: {path} line {number}: request_id {rid!r} is already used on line {lines_of_id[rid]} "
                    "(each request needs its own id: one result line per id); nothing was served")
        if isinstance(rid, str):
            lines_of_id[rid] = number
        requests.append(value)
    return requests


def generate(args: argparse.Namespace) -> int:
    """``moelora generate``: one engine here, or one per rank (the module doc)."""
    if args.tp == 1 and args.ep == 1:
        return serve(args)
    from moelora_core.checkpoint import read_model_config
    from moelora_core.errors import MoeLoraError
    from moelora_runner.parallel import launch
    from moelora_runner.parallel.layout import ParallelLayout

    requests = _read_requests(args.requests)  # a bad file is refused here, once, before any worker starts
    if isinstance(requests, str):
        return _fail(requests)
    try:
        layout = ParallelLayout(args.tp, args.ep)
        layout.check(read_model_config(args.model))
    except MoeLoraError as exc:
        return _fail(f"moelora: cannot start: {type(exc).__name__}: {exc}")
    launched = launch.torchrun_rank()
    if launched is None:
        return launch.spawn(_serve_rank, layout.world, args, device=args.device)[0]
    rank, world, local_rank = launched
    if world != layout.world:
        return _fail(f"moelora: torchrun started {world} ranks; --tp {args.tp} --ep {args.ep} needs {layout.world}")
    from moelora_runner.parallel.comm import init_group

    device = launch.worker_device(args.device, local_rank)
    init_group(rank=rank, world=world, device=device)
    import torch.distributed as dist

    status = serve(args, rank)
    dist.barrier()  # every rank tears down together (see parallel.launch._worker)
    dist.destroy_process_group()
    return status


def _serve_rank(rank: int, args: argparse.Namespace) -> int:
    return serve(args, rank)


def serve(args: argparse.Namespace, rank: int = 0) -> int:
    """One engine serving the request file; the exit status. On ranks other than 0 (a worker of a TP / EP
    group, its process group already running) nothing is printed or written."""
    from rich.console import Console

    from moelora_core.checkpoint import AdapterWarning
    from moelora_core.errors import MoeLoraError
    from moelora_runner import cli_report
    from moelora_runner.engine import Engine
    from moelora_runner.errors import GenerateInterrupted
    from moelora_runner.parallel.launch import worker_device

    lead = rank == 0
    requests = _read_requests(args.requests)
    if isinstance(requests, str):
        return _fail(requests)
    device = worker_device(args.device, rank) if (args.tp > 1 or args.ep > 1) else args.device
    try:
        engine = Engine(args.model, backend=args.backend, dtype=args.dtype, device=device, tp=args.tp, ep=args.ep,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_loras_per_batch=args.max_loras_per_batch, expert_layout=args.expert_layout,
                        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens,
                        moe_impl=args.moe_impl, graph=args.graph, decode_graph=args.decode_graph,
                        max_num_requests=args.max_num_requests, prefill_token_buckets=args.prefill_token_buckets,
                        decode_batch_buckets=args.decode_batch_buckets)
    except MoeLoraError as exc:
        return _fail(f"moelora: cannot start: {type(exc).__name__}: {exc}")
    notes = []
    for name, path in args.adapter:
        try:
            with warnings.catch_warnings():  # printed below as one line each, not as Python warnings
                warnings.simplefilter("ignore", AdapterWarning)
                engine.load_adapter(name, path)
        except MoeLoraError as exc:
            return _fail(f"moelora: adapter {name!r} refused: {type(exc).__name__}: {exc}")
        notes += engine.adapter_warnings(name)
    console = Console(stderr=True, quiet=not lead)
    for note in notes:  # a no-op adapter is served, and named (moelora_core.checkpoint.adapter_effect)
        console.print(f"moelora: warning: {note}", style="yellow", highlight=False, soft_wrap=True)
    console.print(cli_report.sizing_line(engine), highlight=False, soft_wrap=True)
    server = None
    if args.metrics_port is not None and lead:
        try:
            server, _ = engine.metrics_.serve(args.metrics_port)
        except OSError as exc:
            return _fail(f"moelora: cannot serve metrics on port {args.metrics_port}: {exc}")
        console.print(f"moelora: metrics on http://127.0.0.1:{server.server_port}/metrics while serving",
                      highlight=False)
    start = time.perf_counter()
    interrupted = None
    try:
        with cli_report.progress(console, len(requests), enabled=lead and not args.no_progress) as bar:
            task = bar.add_task("generate", total=len(requests))
            outputs = engine.generate(requests, on_output=lambda out: bar.advance(task))
    except GenerateInterrupted as exc:  # Ctrl-C: write what finished, say so, exit 130 (no traceback)
        interrupted = exc
        outputs = [o for o in exc.outputs if o is not None]
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    seconds = time.perf_counter() - start
    failed = EXIT_FAILED_REQUESTS if any(o.finish_reason == "error" for o in outputs) else EXIT_OK
    if not lead:
        return EXIT_INTERRUPTED if interrupted is not None else failed
    # the file is rewritten even when interrupted: an earlier run's results never stay looking current
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as fh:
        for out in outputs:
            fh.write(json.dumps(out.to_json()) + "\n")
    if args.metrics_file is not None:
        args.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_file.write_text(engine.metrics_.text())
    if interrupted is not None:
        console.print(f"moelora: interrupted (Ctrl-C) after {seconds:.2f} s: {len(outputs)} of {len(requests)} "
                      f"requests finished; {args.output} holds their results only, in input order", highlight=False,
                      soft_wrap=True)
        return EXIT_INTERRUPTED
    table, line = cli_report.summary_table(outputs, seconds)
    console.print(table)
    console.print(cli_report.passes_table(engine))
    console.print(line, highlight=False, soft_wrap=True)
    for out in outputs:
        for warning in out.warnings:
            console.print(f"moelora: request {out.request_id!r}: {warning}", highlight=False, soft_wrap=True)
        if out.finish_reason == "error":
            console.print(f"moelora: request {out.request_id!r} failed: {out.error['type']}: {out.error['message']}",
                          highlight=False, soft_wrap=True)
    return failed


def make_fixtures(args: argparse.Namespace) -> int:
    try:
        from moelora_conformance.fixtures import build_fixtures
    except ImportError as exc:
        return _fail(f"moelora: make-fixtures needs moelora-conformance with its fixtures extra "
                     f"(pip install -e './conformance[fixtures]'): {exc}")
    fixtures = build_fixtures(args.directory)
    m = fixtures.manifest
    print(f"built {len(m['models'])} models, {len(m['adapters'])} adapters, {len(m['bad_adapters'])} bad adapters "
          f"in {args.directory}")
    for name in sorted(m["models"]):
        adapters = sorted(a for a, e in m["adapters"].items() if e["model"] == name)
        print(f"  models/{name}: adapters {', '.join(adapters) or '-'}")
    return EXIT_OK


def _output_argument(argv: list[str]) -> Path | None:
    """``generate``'s ``--output`` read from ``argv`` without the full parser (whose choices import torch),
    so a Ctrl-C during those imports still knows the file; None for another command or none given."""

    class Quiet(argparse.ArgumentParser):
        def error(self, message: str):  # the full parser reports usage errors, once
            raise ValueError(message)

    light = Quiet(add_help=False)
    light.add_argument("command", nargs="?")
    light.add_argument("--output", type=Path)
    try:
        known, _ = light.parse_known_args(argv)
    except ValueError:
        return None
    return known.output if known.command == "generate" else None


def _run(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on a usage error, 0 for --help
        return int(exc.code or 0)
    if args.command != "generate":
        return make_fixtures(args)
    return generate(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moelora`` console script; returns the exit status.

    Ctrl-C at any point before serving began (importing torch, reading the model or the adapters; serve()
    handles it later) prints one line and returns 130, no traceback, and empties an existing ``--output``:
    an earlier run's results must never look like this run's (the module doc)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    output = _output_argument(argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        where = "nothing was written"
        if output is not None and output.exists():
            output.write_text("")
            where = f"{output} is empty"
        print(f"moelora: interrupted (Ctrl-C) before any request ran; {where}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
