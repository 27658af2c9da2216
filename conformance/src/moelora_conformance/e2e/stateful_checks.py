"""What the E06 state machine (:mod:`.stateful`) compares, kept apart from its rules: the weights
each (adapter, version) means, the pool's slot tensors and a snapshot of everything a refused
operation must leave unchanged, the forward pass a step must be counted with (from the engine's graph
configuration alone), and a finished request against the same request alone.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from moelora_core import LogprobCheck, logprob_tolerance


class AdapterVersions:
    """The weights each (name, version) means: version 0 is the name's own directory; version v > 0 is
    the files of the adapter v places further on in the list, with every ``lora_B`` multiplied by
    (-1)^v · (1 + v/2) — other modules, ranks and σ, and other values, under the same name."""

    def __init__(self, adapters: tuple[tuple[str, Path], ...]) -> None:
        self.names = [n for n, _ in adapters]
        self.paths = dict(adapters)
        self._files: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}

    def files(self, name: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors and config of adapter directory ``name`` (read once)."""
        if name not in self._files:
            from safetensors.torch import load_file

            path = self.paths[name]
            self._files[name] = (load_file(str(path / "adapter_model.safetensors")),
                                 json.loads((path / "adapter_config.json").read_text()))
        return self._files[name]

    def version(self, name: str, v: int) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, config) of version ``v`` > 0 of ``name``."""
        source = self.names[(self.names.index(name) + v) % len(self.names)]
        tensors, config = self.files(source)
        factor = (-1) ** v * (1 + v / 2)
        return ({k: t * factor if ".lora_B." in k else t.clone() for k, t in tensors.items()}, dict(config))

    def load(self, engine, name: str, v: int) -> None:
        """Register version ``v`` of ``name`` on ``engine`` (a directory, or in-memory tensors). The engine's
        warnings on no-op adapters are silenced here: the run named the user's adapters once, at its start,
        and a version may carry another (no-op) adapter's files on purpose."""
        from moelora_core.checkpoint import AdapterWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AdapterWarning)
            if v == 0:
                engine.load_adapter(name, self.paths[name])
            else:
                engine.load_adapter_from_tensors(name, *self.version(name, v))


def adapter_max_rank(path: Path) -> int:
    """The largest rank an adapter's ``adapter_config.json`` gives a module (``r``, ``rank_pattern``).

    Raises:
        ValueError: no readable ``adapter_config.json`` with an integer ``r`` (the message names the path).
    """
    file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
        ranks = [int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a PEFT LoRA adapter directory: {file.name} unreadable or without "
                         f"an integer 'r' ({type(exc).__name__}: {exc})") from None
    return max(ranks)


def pool_rank(adapters: Mapping[str, Path]) -> int:
    """R for the machine's engines: the adapters' largest rank, rounded up to a power of two."""
    r = max(adapter_max_rank(p) for p in adapters.values())
    return 1 << max(0, math.ceil(math.log2(r)))


# --- what the machine compares ---------------------------------------------------------------------


def slot_tensors(pool, slot: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of one slot of one layer's pool (factors, ranks, σ), by name."""
    out = [("gate_up_A", pool.gate_up_A[:, slot]), ("gate_up_B", pool.gate_up_B[:, slot]),
           ("down_A", pool.down_A[slot]), ("down_B", pool.down_B[slot]),
           ("module_ranks", pool.module_ranks[:, slot]), ("module_scalings", pool.module_scalings[:, slot])]
    out += [(f"dense_A.{m}", t[slot]) for m, t in pool.dense_A.items()]
    out += [(f"dense_B.{m}", t[slot]) for m, t in pool.dense_B.items()]
    return out


def snapshot(engine) -> dict:
    """Everything a refused operation must leave unchanged."""
    pool = engine.adapters
    return {"registry": {n: id(pool.get(n).weights) for n in pool.names()}, "slots": pool.slots(),
            "pinned": pool.pinned(), "kv_free": engine.kv.free_tokens, "waiting": len(engine.scheduler.waiting),
            "running": len(engine.scheduler.running),
            "tensors": [[t.clone() for _, t in slot_tensors(p, s)] for p in pool.pools for s in range(pool.max_loras)]}


def assert_unchanged(before: dict, after: dict, what: str) -> None:
    for key in ("registry", "slots", "pinned", "kv_free", "waiting", "running"):
        assert before[key] == after[key], f"{what} changed {key}: {before[key]} -> {after[key]}"
    for i, (b, a) in enumerate(zip(before["tensors"], after["tensors"])):
        assert all(torch.equal(x, y) for x, y in zip(b, a)), f"{what} changed pool tensors (layer x slot {i})"


def pass_counts(engine) -> dict[tuple[str, str, str], float]:
    out = {}
    for metric in engine.metrics.collect():
        if metric.name == "moelora_forward_passes":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["phase"], s.labels["mode"], s.labels["reason"])] = s.value
    return out


def expected_pass(graphs, forward_mode: str, requests: int, tokens: int) -> tuple[str, str, str]:
    """(phase, mode, reason) a step must be counted with, from the engine's resolved ``GraphConfig``
    alone (DESIGN.md §6: a prefill graph has ``max_num_requests`` request slots, no 32 cap)."""
    if forward_mode == "idle":
        return ("idle", "eager", "disabled")
    if forward_mode == "decode":
        if not graphs.decode_graph:
            return ("decode", "eager", "disabled")
        return ("decode", "eager", "over_requests") if requests > max(graphs.decode_buckets) else \
            ("decode", "decode_graph", "")
    if graphs.prefill == "eager":
        return ("prefill", "eager", "disabled")
    if requests > graphs.max_num_requests:
        return ("prefill", "eager", "over_requests")
    if tokens > max(graphs.prefill_buckets):
        return ("prefill", "eager", "over_tokens")
    return ("prefill", graphs.prefill, "")


def compare_with_alone(got, want, check: LogprobCheck, request: dict, what: str) -> None:
    """``got`` (batched) against ``want`` (the request alone): prompt logprobs; output tokens up to the
    alone run's first top-2 margin of at most 2·max_abs (greedy; a flip there is within tolerance),
    everywhere for sampled requests (their own generator); their logprobs; the finish reason once
    every token agrees.

    Raises:
        AssertionError: naming the request and the first difference.
    """
    assert got.finish_reason in ("stop", "length"), f"{what}: finished with {got.finish_reason} {got.error}"
    check.add(got.prompt_logprobs[1:], want.prompt_logprobs[1:], what=f"{what} prompt logprobs")
    agree = len(want.output_token_ids)
    if request["temperature"] == 0.0:
        tol = check.tolerance.max_abs
        margins = [t[0]["logprob"] - t[1]["logprob"] for t in want.top_logprobs]
        agree = next((j for j, m in enumerate(margins) if m <= 2 * tol), agree)
    assert got.output_token_ids[:agree] == want.output_token_ids[:agree], (
        f"{what}: output tokens {got.output_token_ids} != alone {want.output_token_ids} (first {agree} compared)")
    check.add(got.output_logprobs[:agree], want.output_logprobs[:agree], what=f"{what} output logprobs")
    if agree == len(want.output_token_ids):
        assert got.output_token_ids == want.output_token_ids and got.finish_reason == want.finish_reason, (
            f"{what}: {got.output_token_ids} ({got.finish_reason}) != alone {want.output_token_ids} "
            f"({want.finish_reason})")


def tolerance_row(dtype: str, base_quant: str = "none") -> str:
    """The logprob row of a batched-and-replayed request against itself alone and eager: the
    graph row's bound is batched_vs_alone's (same cause: other matmul shapes); bf16 has only the
    graph row. ``base_quant``: the model's base storage (an fp8 block-scaled base has rows of its own)."""
    for row in ("batched_vs_alone", "graph_vs_eager"):
        try:
            logprob_tolerance(row, dtype, base_quant=base_quant)
            return row
        except KeyError:
            continue
    raise KeyError(f"no batched_vs_alone or graph_vs_eager logprob tolerance for {dtype} (base_quant={base_quant})")
