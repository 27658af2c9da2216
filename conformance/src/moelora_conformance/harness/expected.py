"""What a layer forward must produce, from the readable oracle (``moelora_reference.oracle``, per
token, float64 on the CPU), and the standard checks of a run against it.

The oracle is fed the run's *actual* MoE input (the break op's output, which carries the dense
deltas), so an error is charged to the part that made it: dense outputs are checked against the
dense oracle, the MoE output against the MoE oracle on the same input, and the break op against
its float64 twin on the run's own dense outputs.

On large (GPU-profile) batches the oracle runs on at most ``oracle_rows`` token rows: every
request's first and last token, then evenly spread rows (the same rows for every check of a run).

Each MoE layer of a two-layer case is checked the same way on its own input (the previous layer's
actual output after the harness's RMS norm), with its own weights, adapters and routing. The oracle
never reads the pools the backend is handed: its adapters are the suite's own record of what it
loaded (:class:`~moelora_conformance.snapshot.AdapterSnapshot`, current after every reload), so a
backend that writes the pool, or a pool that keeps stale modules, cannot move the expected values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_conformance.harness.break_op import break_op_f64
from moelora_conformance.harness.checks import (
    BaseRowMismatch,
    CheckContext,
    DeltaMismatch,
    LayoutMismatch,
    OutputMismatch,
    PadRowMismatch,
    accumulation_bound,
    assert_bitwise,
    assert_close,
    assert_delta_close,
    base_row_mask,
    classified,
)
from moelora_conformance.harness.inputs import BatchInputs
from moelora_conformance.harness.layer import GUARD_VALUE, Layer, LayerOutput, inter_layer_norm
from moelora_conformance.harness.moe_rounding import dense_activation_rounding, moe_rounding_scale
from moelora_conformance.snapshot import PoolView
from moelora_core.batch import BatchSpec
from moelora_core.weights import LoRAWeights
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


@dataclass(frozen=True)
class MoEExpected:
    """Oracle values of one MoE layer on its run input, on the checked rows (float64, CPU).

    Attributes:
        y: [n, H] output with LoRA. delta: [n, H] ``y`` minus the oracle without LoRA.
        delta_rounding: [n, H] what a correct run's delta may be off by (roundings the backend and the
            stored intermediates make: :func:`~.moe_rounding.moe_rounding_scale`).
        output_rounding: [n, H] the same for the output itself (base pairs' roundings included): a
            small output next to a large delta carries the delta's roundings too.
    """

    y: torch.Tensor
    delta: torch.Tensor
    delta_rounding: torch.Tensor
    output_rounding: torch.Tensor


@dataclass
class Expected:
    """Oracle values on the checked rows (float64, CPU).

    Attributes:
        rows: the row index (None = all rows).
        moe: every MoE layer's :class:`MoEExpected`, layer 1 first.
        dense: module → [n, out] dense output with LoRA; dense_delta: module → [n, out] σ·B(A x).
        dense_accumulation: module → [n, out] the rounding error a correct ``dense_delta`` may carry:
            its fp32 accumulation (:func:`~.checks.accumulation_bound` of
            :func:`dense_delta_rounding_scale`) and its shrink output and delta rounded to the
            activation dtype (:func:`~.moe_rounding.dense_activation_rounding`).
    """

    rows: torch.Tensor | None
    moe: list[MoEExpected]
    dense: dict[str, torch.Tensor]
    dense_delta: dict[str, torch.Tensor]
    dense_accumulation: dict[str, torch.Tensor]

    @property
    def y(self) -> torch.Tensor:
        """Layer 1's output with LoRA."""
        return self.moe[0].y

    @property
    def y_delta(self) -> torch.Tensor:
        """Layer 1's LoRA delta."""
        return self.moe[0].delta


class Oracle:
    """The oracle for one layer: its base weights (a CPU copy on CUDA) and the adapters of the
    layer's snapshot, never its pools."""

    def __init__(self, layer: Layer, *, oracle_rows: int | None = None) -> None:
        self.layer = layer
        self.oracle_rows = oracle_rows
        self._m = None

    @property
    def m(self):
        """The layer's ``MaterializedCase`` on the CPU (its base and dense weights are read)."""
        if self._m is None:
            layer = self.layer
            self._m = layer.m if layer.device.type == "cpu" else layer.m.to("cpu")
        return self._m

    def adapters(self, layer: int):
        """MoE layer ``layer``'s adapters as the suite loaded them (a ``PoolView`` of the snapshot)."""
        return self.layer.snapshot.pool_view(layer)

    def _take(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        t = t.detach().to("cpu")
        return t if rows is None else t[rows]

    def _moe(self, moe_in, ids, w, base, lora, mapping, rows) -> MoEExpected:
        """The oracle values of one MoE layer on its run input ``moe_in``."""
        x, ids, w = self._take(moe_in, rows), self._take(ids, rows), self._take(w, rows)
        # GPT-OSS's expert biases and activation; None / SiLU for the other families (DESIGN.md §1)
        block = dict(b_gate_up=base.b_gate_up, b_down=base.b_down, activation=base.activation,
                     # an fp8 block-scaled base: the oracle's w8a8 (DESIGN.md §1)
                     weight_block=base.weight_block, w_gate_up_scale_inv=base.w_gate_up_scale_inv,
                     w_down_scale_inv=base.w_down_scale_inv)
        y = moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, lora, mapping, **block)
        delta = y - moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, None, None, **block)
        layer = self.layer
        # a fused moe_forward may store its intermediates in the model dtype, as an engine does
        stored = layer.spec.dtype if layer.moe_path == "fused" else layer.intermediate_dtype
        kw = dict(act_dtype=layer.spec.dtype, intermediate_dtype=stored)
        rounding = moe_rounding_scale(x, ids, w, base, lora, mapping, **kw)
        output = moe_rounding_scale(x, ids, w, base, lora, mapping, include_base=True, **kw)
        return MoEExpected(y, delta, rounding, output)

    def expected(self, inp: BatchInputs, run: LayerOutput) -> Expected:
        """Oracle values for ``run`` (a forward of ``inp`` with LoRA)."""
        m, batch = self.m, inp.batch
        rows = oracle_row_index(batch, self.oracle_rows)
        mapping = self._take(torch.tensor(batch.token_lora_mapping, dtype=torch.int32), rows)
        lora = self.adapters(0)
        moe = [self._moe(run.moe_in, inp.topk_ids, inp.topk_weights, m.base, lora, mapping, rows)]
        moe += [
            self._moe(e.moe_in, ids, w, layer.base, self.adapters(n), mapping, rows)
            for n, (e, (ids, w), layer) in enumerate(zip(run.extra, inp.extra_routing, m.layers, strict=True), 1)
        ]
        dense, dense_delta, accumulation = {}, {}, {}
        for mod, x in inp.dense_x.items():
            xr = self._take(x, rows)
            dense_delta[mod] = dense_lora_forward(xr, None, mod, lora, mapping)
            dense[mod] = dense_lora_forward(xr, m.dense_weights[mod], mod, lora, mapping)
            accumulation[mod] = (accumulation_bound(dense_delta_rounding_scale(xr, mod, lora, mapping))
                                 + dense_activation_rounding(xr, mod, lora, mapping, act_dtype=self.layer.spec.dtype))
        return Expected(rows, moe, dense, dense_delta, accumulation)


def dense_delta_rounding_scale(
    x: torch.Tensor, module: str, lora: LoRAWeights | PoolView, token_lora_mapping: torch.Tensor
) -> torch.Tensor:
    """The scale of the fp32 rounding error of a dense LoRA delta ``σ·B(A x)``, per token and column.

    ``s_tj = |σ_s|·(‖|B_s[j]| ⊙ m_t‖₂ + |B_s[j]|·|A_s x_t|)`` with ``m_t,r = Σ_i |A_s[r,i] x_t,i|``:
    each shrink sum is off by a small multiple of ``u·m`` (its partial sums walk randomly on
    mean-zero data), the R shrink errors are independent so they reach column j in ℓ2 through
    ``B``, and the expand sum and σ add rounding on ``|B||A x|``. Large where ``A x`` cancels; see
    the module docstring of :mod:`~.checks` for the model and its measurement.

    Args:
        x: [T, in] the module's input; module: "q", "k", "v" or "o"; lora: the pool;
        token_lora_mapping: [T] slot per token (``NO_ADAPTER`` rows get 0).

    Returns:
        [T, out] float64 on the CPU, non-negative.
    """
    A, B = lora.factors(module)
    A, B = A.detach().to("cpu", F64), B.detach().to("cpu", F64).abs()
    sigma = lora.scalings(module).detach().to("cpu", F64).abs()
    mapping = token_lora_mapping.to("cpu", torch.long)
    out = torch.zeros(x.shape[0], B.shape[-2], dtype=F64)
    x64 = x.detach().to("cpu", F64)
    for slot in sorted({int(s) for s in mapping.tolist() if s >= 0}):
        rows = mapping == slot
        m = x64[rows].abs() @ A[slot].abs().T  # [t, R] Σ|A x| per rank row
        t = (x64[rows] @ A[slot].T).abs()  # [t, R] |A x|
        out[rows] = sigma[slot] * ((m.square() @ B[slot].square().T).sqrt() + t @ B[slot].T)
    return out


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows.to(t.device)]


@dataclass(frozen=True)
class _MoELayerRun:
    """One MoE layer of a run for the checks: its outputs, its twin's, and the oracle's values."""

    name: str
    y: torch.Tensor
    y32: torch.Tensor | None
    y_base: torch.Tensor
    y32_base: torch.Tensor | None
    want: MoEExpected


def check_run(
    oracle: Oracle,
    inp: BatchInputs,
    run: LayerOutput,
    base: LayerOutput,
    ctx: CheckContext,
    what: str,
    *,
    outputs: bool = True,
    deltas: bool = True,
    base_rows: bool = True,
    pad_rows: bool = False,
) -> Expected:
    """The standard checks of one forward with LoRA (``run``) and its LoRA-disabled twin (``base``,
    from ``Layer.disabled`` / ``GraphLayer.disabled``).

    Args:
        outputs: MoE and dense outputs equal the oracle (and the break op its float64 twin).
        deltas: the LoRA deltas (MoE and dense) equal the oracle's.
        base_rows: rows of tokens without an adapter are bit-identical to the LoRA-disabled run.
        pad_rows: graph runs: every row past the live tokens (``run.rows`` vs ``base.rows``, both
            capacity-wide) is bit-identical to the LoRA-disabled run (a stale tail would add LoRA).

    Every MoE layer of the run gets the MoE checks; the guard columns of a ``fused-qkv`` dense
    buffer must still hold :data:`~.layer.GUARD_VALUE` on every row (always checked). Each kind of
    check fails with its own ``OracleMismatch`` subclass (``checks.classified``): output, delta, base
    rows, pad rows, layout.

    Returns:
        The oracle values (for further checks).
    """
    exp = oracle.expected(inp, run)
    r = exp.rows
    layers = [_MoELayerRun("MoE", run.y, run.y32, base.y, base.y32, exp.moe[0])]
    layers += [
        _MoELayerRun(f"MoE layer {n + 2}", e.y, e.y32, b.y, b.y32, want)
        for n, (e, b, want) in enumerate(zip(run.extra, base.extra, exp.moe[1:], strict=True))
    ]
    if outputs:
        with classified(OutputMismatch):
            _check_outputs(layers, run, exp, inp, ctx, what, r)
    if deltas:
        with classified(DeltaMismatch):
            _check_deltas(layers, run, base, exp, ctx, what, r)
    if base_rows:
        with classified(BaseRowMismatch):
            _check_base_rows(layers, run, base, inp, ctx, what)
    if pad_rows:
        with classified(PadRowMismatch):
            _check_pad_rows(run, base, inp, ctx, what)
    with classified(LayoutMismatch):
        _check_layout(run, ctx, what)
    return exp


def _check_outputs(layers, run: LayerOutput, exp: Expected, inp: BatchInputs, ctx: CheckContext, what: str,
                   r) -> None:
    for lay in layers:
        # the policy's bounds after the derived roundings (the MoE's and y's own) are allowed
        assert_delta_close(_rows(lay.y, r), torch.zeros_like(lay.want.y), lay.want.y, ctx,
                           f"{what}: {lay.name} output", rounded=(_rows(lay.y, r),),
                           accumulation=lay.want.output_rounding, quantity="output")
    for mod, t in run.dense.items():
        # the output's own rounding and the delta's (a small output next to a large delta carries them)
        assert_delta_close(_rows(t, r), torch.zeros_like(exp.dense[mod]), exp.dense[mod], ctx,
                           f"{what}: dense {mod} output", rounded=(_rows(t, r),),
                           accumulation=exp.dense_accumulation[mod], quantity="output")
    want_in = break_op_f64(inp.x, run.dense, inp.batch)
    assert_close(run.moe_in, want_in, ctx, f"{what}: harness break op (MoE input)")


def _check_deltas(layers, run: LayerOutput, base: LayerOutput, exp: Expected, ctx: CheckContext, what: str,
                  r) -> None:
    for lay in layers:
        if lay.y32 is not None and lay.y32_base is not None:
            assert_delta_close(_rows(lay.y32, r), _rows(lay.y32_base, r), lay.want.delta, ctx,
                               f"{what}: {lay.name} LoRA delta", accumulation=lay.want.delta_rounding)
        else:
            assert_delta_close(_rows(lay.y, r), _rows(lay.y_base, r), lay.want.delta, ctx,
                               f"{what}: {lay.name} LoRA delta", rounded=(_rows(lay.y, r), _rows(lay.y_base, r)),
                               accumulation=lay.want.delta_rounding)
    for mod, t in run.dense.items():
        assert_delta_close(_rows(t, r), _rows(base.dense[mod], r), exp.dense_delta[mod], ctx,
                           f"{what}: dense {mod} LoRA delta", rounded=(_rows(t, r),),
                           accumulation=exp.dense_accumulation[mod])


def _check_base_rows(layers, run: LayerOutput, base: LayerOutput, inp: BatchInputs, ctx: CheckContext,
                     what: str) -> None:
    mask = base_row_mask(inp.batch.token_lora_mapping, run.y.device)
    for lay in layers:
        assert_bitwise(lay.y[mask], lay.y_base[mask], ctx, f"{what}: {lay.name} output of base rows vs LoRA disabled")
    for mod, t in run.dense.items():
        assert_bitwise(t[mask], base.dense[mod][mask], ctx,
                       f"{what}: dense {mod} output of base rows vs LoRA disabled")


def _check_pad_rows(run: LayerOutput, base: LayerOutput, inp: BatchInputs, ctx: CheckContext, what: str) -> None:
    T = inp.num_tokens
    full, twin = run.rows, base.rows
    pairs = [("MoE", full["y"], twin["y"])]
    pairs += [(f"MoE layer {n + 2}", e.y, b.y) for n, (e, b) in enumerate(zip(full["extra"], twin["extra"]))]
    for name, y, y_base in pairs:
        assert_bitwise(y[T:], y_base[T:], ctx,
                       f"{what}: {name} output of pad rows (past {T} live tokens) vs LoRA disabled")
    for mod, t in full["dense"].items():
        assert_bitwise(t[T:], twin["dense"][mod][T:], ctx, f"{what}: dense {mod} output of pad rows vs LoRA disabled")


def _check_layout(run: LayerOutput, ctx: CheckContext, what: str) -> None:
    # each later MoE layer ran on the harness's norm of the previous layer's output, on every row
    # (capacity-wide in graph runs, same shapes as in the run): a backend that writes into its
    # input x shows here (before the norm, layer 2's input was layer 1's checked y)
    every_row = run.all_rows()
    prev = every_row["y"]
    for n, e in enumerate(every_row["extra"]):
        assert_bitwise(e.moe_in, inter_layer_norm(prev), ctx,
                       f"{what}: MoE layer {n + 2} input vs the norm of layer {n + 1}'s output")
        prev = e.y
    guards = every_row["guards"]
    if guards is not None:
        assert_bitwise(guards, torch.full_like(guards, GUARD_VALUE), ctx,
                       f"{what}: guard columns of the fused q|k|v output buffer (outside every module's slice)")
