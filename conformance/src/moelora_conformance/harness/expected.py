"""What a layer forward must produce, from the readable oracle (``moelora_reference.oracle``, per
token, float64 on the CPU), and the standard checks of a run against it.

The oracle is fed the run's *actual* MoE input (the break op's output, which carries the dense
deltas), so an error is charged to the part that made it: dense outputs are checked against the
dense oracle, the MoE output against the MoE oracle on the same input, and the break op against
its float64 twin on the run's own dense outputs.

On large (GPU-profile) batches the oracle runs on at most ``oracle_rows`` token rows: every
request's first and last token, then evenly spread rows (the same rows for every check of a run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_conformance.harness.break_op import break_op_f64
from moelora_conformance.harness.checks import (
    CheckContext,
    assert_bitwise,
    assert_close,
    assert_delta_close,
    base_row_mask,
)
from moelora_conformance.harness.inputs import BatchInputs
from moelora_conformance.harness.layer import Layer, LayerOutput
from moelora_core.batch import BatchSpec
from moelora_reference.oracle import dense_lora_forward, moe_lora_forward

F64 = torch.float64


def oracle_row_index(batch: BatchSpec, budget: int | None) -> torch.Tensor | None:
    """Rows the oracle evaluates: None = all; else at most ``budget`` rows, every request's first
    and last token first."""
    T = batch.num_tokens
    if budget is None or T <= budget:
        return None
    picked: list[int] = []
    seen: set[int] = set()
    starts = batch.req_seg_indptr
    candidates = [starts[q] for q in range(batch.bs)] + [starts[q + 1] - 1 for q in range(batch.bs)]
    step = max(1, T // budget)
    candidates += list(range(0, T, step))
    for r in candidates:
        if r not in seen and len(picked) < budget:
            seen.add(r)
            picked.append(r)
    return torch.tensor(sorted(picked), dtype=torch.long)


@dataclass
class Expected:
    """Oracle values on the checked rows (float64, CPU).

    Attributes:
        rows: the row index (None = all rows).
        y: [n, H] MoE output with LoRA on the run's MoE input.
        y_delta: [n, H] ``y`` minus the oracle without LoRA on the same MoE input.
        dense: module → [n, out] dense output with LoRA; dense_delta: module → [n, out] σ·B(A x).
    """

    rows: torch.Tensor | None
    y: torch.Tensor
    y_delta: torch.Tensor
    dense: dict[str, torch.Tensor]
    dense_delta: dict[str, torch.Tensor]


class Oracle:
    """The oracle for one layer (a CPU copy of its weights, made once)."""

    def __init__(self, layer: Layer, *, oracle_rows: int | None = None) -> None:
        self.m = layer.m if layer.device.type == "cpu" else layer.m.to("cpu")
        self.oracle_rows = oracle_rows

    def _take(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        t = t.detach().to("cpu")
        return t if rows is None else t[rows]

    def expected(self, inp: BatchInputs, run: LayerOutput) -> Expected:
        """Oracle values for ``run`` (a forward of ``inp`` with LoRA)."""
        m, batch = self.m, inp.batch
        rows = oracle_row_index(batch, self.oracle_rows)
        mapping = self._take(torch.tensor(batch.token_lora_mapping, dtype=torch.int32), rows)
        ids, w = self._take(inp.topk_ids, rows), self._take(inp.topk_weights, rows)
        W_gu, W_d = m.base.w_gate_up, m.base.w_down
        y = moe_lora_forward(self._take(run.moe_in, rows), ids, w, W_gu, W_d, m.lora, mapping)
        y_base = moe_lora_forward(self._take(run.moe_in, rows), ids, w, W_gu, W_d, None, None)
        dense, dense_delta = {}, {}
        for mod, x in inp.dense_x.items():
            xr = self._take(x, rows)
            dense_delta[mod] = dense_lora_forward(xr, None, mod, m.lora, mapping)
            dense[mod] = dense_lora_forward(xr, m.dense_weights[mod], mod, m.lora, mapping)
        return Expected(rows, y, y - y_base, dense, dense_delta)


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows.to(t.device)]


def check_run(oracle: Oracle, inp: BatchInputs, run: LayerOutput, base: LayerOutput, ctx: CheckContext,
              what: str, *, outputs: bool = True, deltas: bool = True, base_rows: bool = True,
              pad_rows: bool = False) -> Expected:
    """The standard checks of one forward with LoRA (``run``) and its LoRA-disabled twin (``base``,
    from ``Layer.disabled`` / ``GraphLayer.disabled``).

    Args:
        outputs: MoE and dense outputs equal the oracle (and the break op its float64 twin).
        deltas: the LoRA deltas (MoE and dense) equal the oracle's.
        base_rows: rows of tokens without an adapter are bit-identical to the LoRA-disabled run.
        pad_rows: graph runs: every row past the live tokens (``run.rows`` vs ``base.rows``, both
            capacity-wide) is bit-identical to the LoRA-disabled run (a stale tail would add LoRA).

    Returns:
        The oracle values (for further checks).
    """
    exp = oracle.expected(inp, run)
    r = exp.rows
    if outputs:
        assert_close(_rows(run.y, r), exp.y, ctx, f"{what}: MoE output")
        for mod, t in run.dense.items():
            assert_close(_rows(t, r), exp.dense[mod], ctx, f"{what}: dense {mod} output")
        want_in = break_op_f64(inp.x, run.dense, inp.batch)
        assert_close(run.moe_in, want_in, ctx, f"{what}: harness break op (MoE input)")
    if deltas:
        if run.y32 is not None and base.y32 is not None:
            assert_delta_close(_rows(run.y32, r), _rows(base.y32, r), exp.y_delta, ctx, f"{what}: MoE LoRA delta")
        else:
            assert_delta_close(_rows(run.y, r), _rows(base.y, r), exp.y_delta, ctx, f"{what}: MoE LoRA delta",
                               rounded=(_rows(run.y, r), _rows(base.y, r)))
        for mod, t in run.dense.items():
            assert_delta_close(_rows(t, r), _rows(base.dense[mod], r), exp.dense_delta[mod], ctx,
                               f"{what}: dense {mod} LoRA delta", rounded=(_rows(t, r),))
    if base_rows:
        mask = base_row_mask(inp.batch.token_lora_mapping, run.y.device)
        assert_bitwise(run.y[mask], base.y[mask], ctx, f"{what}: MoE output of base rows vs LoRA disabled")
        for mod, t in run.dense.items():
            assert_bitwise(t[mask], base.dense[mod][mask], ctx,
                           f"{what}: dense {mod} output of base rows vs LoRA disabled")
    if pad_rows:
        T = inp.num_tokens
        full = run.rows
        assert_bitwise(full["y"][T:], base.rows["y"][T:], ctx,
                       f"{what}: MoE output of pad rows (past {T} live tokens) vs LoRA disabled")
        for mod, t in full["dense"].items():
            assert_bitwise(t[T:], base.rows["dense"][mod][T:], ctx,
                           f"{what}: dense {mod} output of pad rows vs LoRA disabled")
    return exp
