"""The real-checkpoint pass's table: one row per model × backend × mode (rich), and its verdict."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

from moelora_conformance.checkpoint_pass.run import PassRow


def summarize(rows: Iterable[PassRow], noop: dict[str, str] | None = None) -> list[dict]:
    """One entry per (model, backend, mode): oracle runs passed, HF comparisons and their worst
    relative error, adapters compared, pass/fail and the first failures; ``noop`` (adapter → why it is a
    no-op): a cell whose compared adapters are all no-ops is "not meaningful"."""
    groups: dict[tuple[str, str, str], list[PassRow]] = {}
    for r in rows:
        groups.setdefault((r.model, r.backend, r.mode), []).append(r)
    out = []
    for (model, backend, mode), rs in groups.items():
        oracle = [r for r in rs if r.check == "oracle"]
        hf = [r for r in rs if r.check == "hf"]
        compared = {r.subject for r in hf} - {"(base)"}
        noop_only = bool(compared) and compared <= set(noop or {})
        notes = [f"L{r.layer} {r.batch} {r.subject} {r.part}: {r.note}" for r in rs if not r.ok]
        refused = [r for r in rs if r.check == "declared"]  # the model's base_quant is not declared
        notes += [r.note for r in refused[:1]]
        if noop_only:
            notes.append(f"not meaningful: every adapter compared is a no-op ({', '.join(sorted(compared))})")
        out.append({
            "model": model, "backend": backend, "mode": mode,
            "oracle": f"{sum(r.ok for r in oracle)}/{len(oracle)}",
            "hf": len(hf), "adapters": len({r.subject for r in hf} - {"(base)"}),
            "max_rel": max((r.max_rel for r in hf if r.max_rel is not None), default=0.0),
            "ok": all(r.ok for r in rs), "noop": noop_only, "notes": notes, "refused": bool(refused),
        })
    return out


def render(rows: list[PassRow], console: Console | None = None, *, noop: dict[str, str] | None = None,
           require_coverage: bool = False) -> bool:
    """Print the table; return whether the run passes: every comparison passed and — with
    ``require_coverage`` — no cell is "not meaningful" (only no-op adapters of ``noop`` compared)."""
    console = console or Console(width=max(Console().width, 150))
    table = Table(title="real-checkpoint pass: backends × layer modes vs the oracle and HF transformers + PEFT "
                        "(fp32, max/RMS relative error bound 1e-5)",
                  caption="oracle: the suite's checks of each run (outputs, LoRA deltas, base and pad rows "
                          "bit-identical to LoRA disabled); HF: each adapter's rows vs the PEFT-wrapped experts / "
                          "projections, base rows vs the model without adapter")
    for col, kw in (("model", {}), ("backend", {}), ("mode", {}), ("oracle runs", {"justify": "right"}),
                    ("adapters", {"justify": "right"}), ("HF checks", {"justify": "right"}),
                    ("max rel err", {"justify": "right"}), ("result", {}), ("notes", {"overflow": "fold"})):
        table.add_column(col, **kw)
    summary = summarize(rows, noop)
    for s in summary:
        result = "[bold red]FAIL[/bold red]" if not s["ok"] else \
            "[yellow]not meaningful[/yellow]" if s["noop"] else \
            "not implemented" if s.get("refused") else "[green]PASS[/green]"
        table.add_row(s["model"], s["backend"], s["mode"], s["oracle"], str(s["adapters"]), str(s["hf"]),
                      f"{s['max_rel']:.2e}", result, "\n".join(s["notes"][:3]))
    console.print(table)
    ok = bool(summary) and all(s["ok"] for s in summary)
    failed = sum(not s["ok"] for s in summary)
    unproven = sum(s["ok"] and s["noop"] for s in summary)
    tail = f"; not proven: {unproven} cell(s) not meaningful (only no-op adapters)" if unproven else ""
    console.print(f"{len(summary)} model/backend/mode cells, {len(rows)} comparisons: "
                  + ("[green]all pass[/green]" if ok else f"[bold red]{failed} cell(s) fail[/bold red]") + tail)
    if unproven and require_coverage:
        console.print("--require-coverage: cells not proven (not meaningful) fail this run")
    return ok and not (require_coverage and unproven)
