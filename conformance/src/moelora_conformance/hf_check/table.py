"""The hf-check table: model × adapter × max relative error, pass / fail (rich)."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

from moelora_conformance.hf_check.compare import CheckRow

#: Short source names for the table (the rows keep the long ones).
_SHORT = {"hf-memory": "mem", "readers": "disk", "readers σ·√2": "disk·σ√2", "per-module": "per-mod",
          "reference-backend": "backend", "engine": "engine"}


def summarize(rows: Iterable[CheckRow], noop: dict[str, str] | None = None) -> list[dict]:
    """One entry per (model, adapter): sources checked, worst error of the comparisons expected to
    agree, smallest visible LoRA delta, pass/fail and notes (first failures, documented divergences);
    ``noop`` (adapter → why it is a no-op): a passing pair of a no-op adapter is "not meaningful"."""
    groups: dict[tuple[str, str], list[CheckRow]] = {}
    for r in rows:
        groups.setdefault((r.model, r.adapter), []).append(r)
    out = []
    for (model, adapter), rs in groups.items():
        # rank/σ rows hold no error; logprobs rows hold absolute logprob differences (a note, below)
        equal = [r for r in rs if r.expect == "equal" and r.part not in ("rank/σ", "logprobs")]
        deltas = [r.delta_rel for r in rs if r.delta_rel is not None and r.source != "readers σ·√2"]
        notes = [f"{r.source} L{r.layer} {r.part}: {r.note.splitlines()[0]}" for r in rs if not r.ok]
        notes += [f"engine logprobs vs HF+PEFT: max |Δ| {r.max_rel:.1e} ({r.note})" for r in rs
                  if r.ok and r.part == "logprobs"]
        diverged = [r for r in rs if r.ok and r.expect == "diverge"]
        if diverged:
            notes.append(f"peft σ differs, as documented (disk vs peft up to {max(r.max_rel for r in diverged):.1e})")
        why = (noop or {}).get(adapter, "")
        if why:
            notes.append(f"not meaningful: the adapter is a no-op ({why}): the checks prove the base model only")
        out.append({
            "model": model, "adapter": adapter, "noop": bool(why),
            "sources": ",".join(dict.fromkeys(_SHORT.get(r.source, r.source) for r in rs)),
            "max_rel": max((r.max_rel for r in equal), default=0.0),
            "min_delta": min(deltas) if deltas else None,
            "ok": all(r.ok for r in rs), "checks": len(rs), "notes": notes,
        })
    return out


def render(rows: list[CheckRow], console: Console | None = None, *, noop: dict[str, str] | None = None,
           require_coverage: bool = False) -> bool:
    """Print the table; return whether the run passes: every check passed and — with
    ``require_coverage`` — no pair is "not meaningful" (a no-op adapter of ``noop``)."""
    console = console or Console(width=max(Console().width, 150))
    table = Table(title="oracle vs HF transformers + PEFT (fp32, max relative error bound 1e-5)",
                  caption="sources: mem = weights from the transformers/peft modules; disk = moelora_core.checkpoint "
                          "readers; per-mod = per-module reference (legacy adapters); disk·σ√2 = peft's converted σ; "
                          "backend = readers → load_adapter_into_slot → reference backend (adapter + base rows); "
                          "engine = whole-model prompt logprobs of moelora_runner (DeepSeek-V3)")
    for col, kw in (("model", {}), ("adapter", {}), ("sources", {}), ("checks", {"justify": "right"}),
                    ("max rel err", {"justify": "right"}), ("min LoRA Δ", {"justify": "right"}),
                    ("result", {}), ("notes", {"overflow": "fold"})):
        table.add_column(col, **kw)
    summary = summarize(rows, noop)
    for s in summary:
        delta = "—" if s["min_delta"] is None else f"{s['min_delta']:.2f}"
        result = "[bold red]FAIL[/bold red]" if not s["ok"] else \
            "[yellow]not meaningful[/yellow]" if s["noop"] else "[green]PASS[/green]"
        table.add_row(s["model"], s["adapter"], s["sources"], str(s["checks"]), f"{s['max_rel']:.2e}", delta,
                      result, "\n".join(s["notes"][-3:] if s["noop"] else s["notes"][:3]))
    console.print(table)
    ok = all(s["ok"] for s in summary)
    failed = sum(not s["ok"] for s in summary)
    unproven = [s["adapter"] for s in summary if s["ok"] and s["noop"]]
    tail = f"; not proven: {len(unproven)} not meaningful ({', '.join(unproven)})" if unproven else ""
    console.print(f"{len(summary)} model/adapter pairs, {len(rows)} checks: "
                  + ("[green]all pass[/green]" if ok else f"[bold red]{failed} pair(s) fail[/bold red]") + tail)
    if unproven and require_coverage:
        console.print("--require-coverage: pairs not proven (not meaningful) fail this run")
    return ok and not (require_coverage and unproven)
