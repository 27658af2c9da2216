"""What ``moelora generate`` shows on stderr: the start-up sizing line (with the graph settings), a rich
progress bar, the summary table (requests, tokens, tokens/s, per adapter) and the forward passes per
phase, mode and fallback reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moelora_runner.requests import RequestOutput


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def sizing_line(engine) -> str:
    """One line: model bytes, KV cache tokens and bytes, bytes per adapter slot, the configuration."""
    s = engine.sizing()
    layout = "" if engine.expert_layout == "per_expert" else f", expert factors {engine.expert_layout}"
    block = getattr(engine, "weight_block", None)
    quant = "" if block is None else f" (base fp8 e4m3, block {block[0]}×{block[1]}, w8a8)"
    return (f"moelora: model {human_bytes(s['model_bytes'])}{quant}; KV cache {s['kv_cache_tokens']} tokens "
            f"({human_bytes(s['kv_cache_bytes'])}, {s['kv_bytes_per_token']} B/token); adapter slot "
            f"{human_bytes(s['adapter_slot_bytes'])} x {s['max_loras']} slots (R {s['max_lora_rank']}{layout}); "
            f"backend {engine.backend_name}, dtype {str(engine.dtype).removeprefix('torch.')}, "
            f"device {engine.device}, moe-impl {engine.moe_impl}; {graphs_text(engine.graphs)}"
            + (f"; {engine.parallel.describe()} (sizes per rank)" if engine.parallel.parallel else ""))


def _buckets(sizes) -> str:
    return ",".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}..{sizes[-1]} in {len(sizes)} buckets"


def graphs_text(g) -> str:
    """The graph settings in a few words (``moelora_runner.graph_config.GraphConfig``)."""
    prefill = "prefill eager" if g.prefill == "eager" else (
        f"prefill {g.prefill} (tokens {_buckets(g.prefill_buckets)}; {g.max_num_requests} request slots)")
    decode = f"decode graph (bs {_buckets(g.decode_buckets)})" if g.decode_graph else "decode eager"
    capture = f", capture {g.capture}" if g.any_graph else ""
    return f"graphs: {prefill}, {decode}{capture}"


def passes_table(engine) -> Table:
    """Forward passes by phase, mode and reason (``moelora_forward_passes_total``)."""
    table = Table(title="forward passes", show_header=True, header_style="bold")
    for name, justify in (("phase", "left"), ("mode", "left"), ("reason", "left"), ("passes", "right")):
        table.add_column(name, justify=justify)
    rows = []
    for metric in engine.metrics_.forward_passes.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                lab = sample.labels
                rows.append((lab["phase"], lab["mode"], lab["reason"] or "-", int(sample.value)))
    for row in sorted(rows):
        table.add_row(*row[:3], str(row[3]))
    return table


def progress(console: Console, total: int, enabled: bool) -> Progress:
    """A progress bar of finished requests (``disable`` when not wanted)."""
    return Progress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not enabled, transient=False)


def summary_table(outputs: Sequence[RequestOutput], seconds: float) -> tuple[Table, str]:
    """Per adapter: requests, failures, prompt and output tokens (a table); and a line with the wall
    time, tokens per second and the finish reasons."""
    reasons = Counter(o.finish_reason for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o.finish_reason != "error")
    generated = sum(len(o.output_token_ids) for o in outputs)
    table = Table(title="moelora generate", show_header=True, header_style="bold")
    table.add_column("adapter")
    table.add_column("requests", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("prompt tokens", justify="right")
    table.add_column("output tokens", justify="right")
    per: dict[str, list[RequestOutput]] = {}
    for o in outputs:
        per.setdefault(o.adapter or "(base)", []).append(o)
    for name in sorted(per):
        group = per[name]
        table.add_row(name, str(len(group)), str(sum(o.finish_reason == "error" for o in group)),
                      str(sum(len(o.prompt_token_ids) for o in group if o.finish_reason != "error")),
                      str(sum(len(o.output_token_ids) for o in group)))
    rate = (prompt + generated) / seconds if seconds > 0 else 0.0
    table.add_section()
    table.add_row("all", str(len(outputs)), str(reasons.get("error", 0)), str(prompt), str(generated))
    line = (f"moelora: {seconds:.2f} s, {rate:.1f} tokens/s ({generated / seconds if seconds > 0 else 0:.1f} output "
            f"tokens/s); finish reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    return table, line
