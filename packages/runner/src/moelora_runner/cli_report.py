"""What ``moelora generate`` shows on stderr: the start-up sizing line, a rich progress bar, and the
summary table (requests, tokens, tokens/s, per adapter)."""

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
    return (f"moelora: model {human_bytes(s['model_bytes'])}; KV cache {s['kv_cache_tokens']} tokens "
            f"({human_bytes(s['kv_cache_bytes'])}, {s['kv_bytes_per_token']} B/token); adapter slot "
            f"{human_bytes(s['adapter_slot_bytes'])} x {s['max_loras']} slots (R {s['max_lora_rank']}); "
            f"backend {engine.backend_name}, dtype {str(engine.dtype).removeprefix('torch.')}, "
            f"device {engine.device}, moe-impl {engine.moe_impl}")


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
