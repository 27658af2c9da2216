"""Comparisons the properties make: against the oracle by the tolerance policy, LoRA deltas with the
output's rounding accounted for, base rows bit for bit.

Every failure message names what was compared, carries the case's one-line description and seed,
and (through :class:`~moelora_core.tolerance.CloseReport`) the first differing coordinates.

The delta check. A LoRA delta is compared on its own so that a wrong delta cannot hide under a
large base output: ``delta = out_lora - out_base`` against the oracle's ``delta``. Where the
compared outputs were rounded to the case dtype (dense outputs; ``moe_forward``'s y) the actual
delta carries up to ``u·|out|`` of rounding per rounded output, whatever the backend does (``u`` the
unit roundoff: 2⁻²⁴ fp32, 2⁻¹¹ fp16, 2⁻⁸ bf16). That part is subtracted element-wise before the
policy's norm bounds apply; the harness's own MoE path keeps y in fp32 (``y32``), so its delta is
compared with no allowance at all.

Accumulation. A dense delta ``σ·B(A x)`` is one scalar ``A x`` per token times a column when the
rank is 1, so on a batch of one token the whole delta tensor can be ill-conditioned at once: where
``A x`` cancels to a few hundredths of ``Σ|A_i x_i|`` or less, the fp32 rounding of that sum,
which every correct kernel makes, exceeds 1e-5 of ``max|delta|``. CI hit it on the inspecting
backend (2026-11-29: P05 decode, rank 1, one token, H=41, max_rel 2.7e-5); a simulation of rank-1
one-token fp32 deltas (H ≤ 64) put the old check's false failures at about 1 draw in 300-400. The
dense delta check therefore also allows, per element, ``λ·u₃₂·s`` with the rounding scale
``s = |σ|·(‖|B_j| ⊙ m‖₂ + |B_j|·|A x|)``, ``m_r = Σ_i |A_ri x_i|`` (see
:func:`~.expected.dense_delta_rounding_scale`). Why this scale: with mean-zero random data a
rounded sum's partial sums walk randomly, so its error is a small multiple of ``u·Σ|terms|``
(not the worst case ``n·u·Σ|terms|``, Higham, *Accuracy and Stability of Numerical Algorithms*,
§3.1, which at the gpu profile's 4096-wide inputs and rank 64 would allow 8 % of the delta), and
the R shrink errors are independent, so they reach the output in ℓ2 through ``B``. Measured
(``test_accumulation_allowance_covers_fp32_sums_in_every_order``; a larger run over in 8-4096,
R 1-64, left-to-right / blocked / pairwise / BLAS sums, σ folded or not, forced cancellation):
worst error 3.5·u·s; :data:`ACCUMULATION_LAMBDA` = 16. Its price on a well-conditioned fp32
delta is a median 1.1e-5 of ``|delta|`` per element at the interpret caps, 1.5e-5 at the dev
caps and 7e-5 at Qwen3 shapes, added to the 1e-5 bound. u₃₂ in every case dtype because DESIGN.md
has kernels accumulate in fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moelora_core.tolerance import DEFAULT_POLICY, TolerancePolicy

#: Unit roundoff of each dtype (half an ulp at 1).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}


class OracleMismatch(AssertionError):
    """A property's run of a batch failed the standard checks every run gets (:func:`check_run`:
    oracle, LoRA delta, base rows, pad rows), a P01-class fault found while another property ran
    its batches: the report marks such a failure
    "FAIL (oracle)" so it is not read as a failure of that property's own claim."""


class OutputMismatch(OracleMismatch):
    """An output (MoE, dense, the harness's break op) differs from the oracle."""


class DeltaMismatch(OracleMismatch):
    """A LoRA delta (output minus the LoRA-disabled twin) differs from the oracle's."""


class BaseRowMismatch(OracleMismatch):
    """A row of a token without an adapter differs, bit for bit, from the LoRA-disabled run."""


class PadRowMismatch(OracleMismatch):
    """A graph run's row past the live tokens differs, bit for bit, from the LoRA-disabled run."""


class LayoutMismatch(OracleMismatch):
    """A write outside the outputs: a guard column of the fused q|k|v buffer, or a layer's input."""


@contextlib.contextmanager
def classified(kind: type[OracleMismatch]):
    """Raise a failed check of the body as ``kind``: each kind of check failure is its own exception
    type, so Hypothesis shrinks (and reports) a delta failure and a base-row failure as two distinct
    failures, and a shrunk example never slips from one kind to another."""
    try:
        yield
    except OracleMismatch:
        raise
    except AssertionError as exc:
        raise kind(str(exc)) from exc


@dataclass(frozen=True)
class CheckContext:
    """What a comparison's failure message needs: the case, the dtype and device, the policy."""

    describe: str
    seed: int
    dtype: torch.dtype
    device: torch.device
    policy: TolerancePolicy = DEFAULT_POLICY
    #: the layer's base quantization: "fp8_block" selects the policy's fp8 rows (DESIGN.md §7).
    base_quant: str = "none"

    def what(self, what: str) -> str:
        return f"{what} | {self.describe}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, ctx: CheckContext, what: str) -> None:
    """``actual`` equals ``expected`` (float64 oracle) within the policy for the case dtype."""
    ctx.policy.assert_close(actual, expected, dtype=ctx.dtype, device=ctx.device, what=ctx.what(what), seed=ctx.seed,
                            base_quant=ctx.base_quant)


#: Multiple of ``u₃₂ · rounding scale`` a dense delta's fp32 accumulation may be off (measured worst: 3.5).
ACCUMULATION_LAMBDA = 16.0


def accumulation_bound(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 accumulation error a correct dense delta may carry: ``λ·u₃₂·scale`` element-wise.

    Args:
        scale: the delta's rounding scale (:func:`~.expected.dense_delta_rounding_scale`), any
            shape, non-negative.

    Returns:
        float64 on the CPU, the shape of ``scale``.

    Raises:
        ValueError: a scale with negative or non-finite elements (not a rounding scale).
    """
    s = scale.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ValueError("a rounding scale must be finite and non-negative")
    return s * (ACCUMULATION_LAMBDA * UNIT_ROUNDOFF[torch.float32])


def assert_delta_close(
    actual_lora: torch.Tensor,
    actual_base: torch.Tensor,
    expected_delta: torch.Tensor,
    ctx: CheckContext,
    what: str,
    *,
    rounded: tuple[torch.Tensor, ...] = (),
    accumulation: torch.Tensor | None = None,
    quantity: str = "LoRA delta",
) -> None:
    """The LoRA delta ``actual_lora - actual_base`` equals ``expected_delta`` within the policy (an
    output is checked the same way with ``actual_base`` zero and ``quantity="output"``).

    Args:
        rounded: the outputs that were rounded to the case dtype (their ``u·|out|`` is allowed).
        accumulation: same shape as ``expected_delta``: the fp32 accumulation error allowed per
            element (:func:`accumulation_bound`), or None for none.
        quantity: what is compared, as the failure message names it ("LoRA delta", "output").

    Raises:
        AssertionError: with the max / RMS relative errors of ``quantity``, the bounds, and the first
            coordinates off (expected and actual ``quantity``).
    """
    tol = ctx.policy.lookup(ctx.dtype, ctx.device, base_quant=ctx.base_quant)
    a = actual_lora.detach().to("cpu", torch.float64) - actual_base.detach().to("cpu", torch.float64)
    e = expected_delta.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{ctx.what(what)}: {quantity} shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    allowance = torch.zeros_like(e)
    u = UNIT_ROUNDOFF[ctx.dtype]
    for t in rounded:
        allowance += u * t.detach().to("cpu", torch.float64).abs()
    if accumulation is not None:
        if accumulation.shape != e.shape:
            raise AssertionError(
                f"{ctx.what(what)}: accumulation bound shape {tuple(accumulation.shape)} != expected {tuple(e.shape)}"
            )
        allowance += accumulation.detach().to("cpu", torch.float64)
    raw = (a - e).abs()
    raw = torch.where(torch.isfinite(raw), raw, torch.full_like(raw, float("inf")))
    err = (raw - allowance).clamp(min=0.0)
    scale = float(e.abs().max()) if e.numel() else 0.0
    norm = float(e.norm()) if e.numel() else 0.0
    max_err = float(err.max()) if err.numel() else 0.0
    max_rel = max_err / scale if scale > 0 else max_err
    rms_rel = float(err.norm()) / norm if norm > 0 else float(err.norm())
    if max_rel <= tol.max_rel and rms_rel <= tol.rms_rel:
        return
    bad = err > tol.max_rel * (scale if scale > 0 else 1.0)
    lines = [
        f"{ctx.what(what)}: {quantity} max_rel={max_rel:.3e} (bound {tol.max_rel:.1e}), rms_rel={rms_rel:.3e} "
        f"(bound {tol.rms_rel:.1e}) [{tol.name}; rounding allowance {'on' if rounded else 'off'}; "
        f"fp32 accumulation allowance {'on' if accumulation is not None else 'off'}]"
    ]
    for idx in bad.nonzero()[:5].tolist():
        i = tuple(idx)
        lines.append(f"    at {i}: expected {quantity} {float(e[i]):.6g}, actual {float(a[i]):.6g}")
    lines.append(f"  seed={ctx.seed}")
    raise AssertionError("\n".join(lines))


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, ctx: CheckContext, what: str) -> None:
    """Bit-for-bit equality (NaNs included), with the first differing coordinates."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{ctx.what(what)}: {tuple(actual.shape)} {actual.dtype} vs expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    same = _bits(actual) == _bits(expected)
    if bool(same.all()):
        return
    diff = (~same).nonzero()[:5].tolist()
    lines = [f"{ctx.what(what)}: {int((~same).sum())} of {actual.numel()} elements differ bitwise; first:"]
    for idx in diff:
        i = tuple(idx)
        lines.append(f"    at {i}: expected {float(expected[i]):.9g}, actual {float(actual[i]):.9g}")
    lines.append(f"  seed={ctx.seed}")
    raise AssertionError("\n".join(lines))


def base_row_mask(token_lora_mapping: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """[T] bool: rows of tokens without an adapter (from the batch's host lists, not the backend's)."""
    return torch.tensor([s < 0 for s in token_lora_mapping], dtype=torch.bool, device=device)
