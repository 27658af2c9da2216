"""The absolute-logprob rows of the tolerance policy (engine-level comparisons).

Covers: every comparison has an fp32 row and every row says whether it was measured; a missing row is
a KeyError naming the rows there are (no silent default); ``LogprobCheck`` fails an item above
max_abs naming the item and position, holds the mean only over a comparison of at least
``MEAN_MIN_SAMPLES`` logprobs (a 2-token prompt's single logprob is its own mean), and refuses
non-finite values and length mismatches.
"""

import pytest
import torch

from moelora_core import LOGPROB_COMPARISONS, LogprobCheck, assert_logprobs_close, logprob_tolerance
from moelora_core.tolerance import LOGPROB_TOLERANCES, MEAN_MIN_SAMPLES


def test_every_comparison_has_an_fp32_row_with_a_status():
    for comparison in LOGPROB_COMPARISONS:
        row = logprob_tolerance(comparison, torch.float32)
        assert row.dtype == "float32" and row.max_abs > 0 and 0 < row.mean_abs <= row.max_abs
    assert {r.status for r in LOGPROB_TOLERANCES.values()} == {"measured", "target"}
    assert logprob_tolerance("engine_vs_hf", "float32").max_abs == 1e-4  # the engine issue's bound


def test_a_missing_row_is_an_error():
    with pytest.raises(KeyError, match="no logprob tolerance for 'tp_vs_tp1' at float16; rows"):
        logprob_tolerance("tp_vs_tp1", torch.float16)


def test_max_is_checked_per_item_and_named():
    check = LogprobCheck("engine_vs_hf", "float32")
    assert check.add([-1.0, -2.0], [-1.0, -2.00005], what="r0") == pytest.approx(5e-5)
    with pytest.raises(AssertionError, match=r"r1: max \|Δlogprob\| 2\.000e-04 > 1\.0e-04.*\[1\] expected -3 actual"):
        check.add([-1.0, -3.0002], [-1.0, -3.0], what="r1")
    with pytest.raises(AssertionError, match="non-finite"):
        check.add([float("nan")], [-1.0], what="r2")
    with pytest.raises(AssertionError, match="2 logprobs, expected 1"):
        check.add([-1.0, -1.0], [-1.0], what="r3")


def test_mean_is_held_only_over_enough_logprobs():
    # One logprob 5e-5 off: within max_abs, above mean_abs, but a sample of one says nothing of the mean.
    assert assert_logprobs_close([-1.00005], [-1.0], comparison="engine_vs_hf", dtype="float32", what="one") \
        == pytest.approx((5e-5, 5e-5))
    many = LogprobCheck("engine_vs_hf", "float32")
    many.add([-1.00005] * MEAN_MIN_SAMPLES, [-1.0] * MEAN_MIN_SAMPLES, what="all off")
    with pytest.raises(AssertionError, match=f"mean .* over {MEAN_MIN_SAMPLES} logprobs"):
        many.finish()
    fine = LogprobCheck("engine_vs_hf", "float32")
    fine.add([-1.00005] + [-1.0] * MEAN_MIN_SAMPLES, [-1.0] * (MEAN_MIN_SAMPLES + 1), what="one off")
    assert fine.finish()[0] == pytest.approx(5e-5)


def test_an_fp8_base_has_its_own_measured_rows_and_no_assumed_ones():
    # a w8a8 model's rows (DESIGN.md §1): fp32 only, for the comparisons a rounding difference crossing an
    # e4m3 midpoint reaches; another dtype or base_quant has no row (its comparison is not run)
    for comparison in ("engine_vs_hf", "graph_vs_eager", "batched_vs_alone"):
        row = logprob_tolerance(comparison, "float32", base_quant="fp8_block")
        assert row.status == "measured" and row.max_abs > logprob_tolerance(comparison, "float32").max_abs
    with pytest.raises(KeyError, match="no logprob tolerance for 'engine_vs_hf' at bfloat16 over base_quant=fp8_block"):
        logprob_tolerance("engine_vs_hf", "bfloat16", base_quant="fp8_block")
    with pytest.raises(KeyError, match="base_quant='mxfp4'"):
        LogprobCheck("engine_vs_hf", "float32", base_quant="mxfp4")
    # engine against engine holds one crossing (nothing to flip); against HF + PEFT made w8a8 a crossing is
    # set aside once proven (e2e.engine_checks.check_against_hf), so that row is the tighter one
    hf_row = logprob_tolerance("engine_vs_hf", "float32", base_quant="fp8_block")
    wide = logprob_tolerance("graph_vs_eager", "float32", base_quant="fp8_block")
    assert hf_row.max_abs < wide.max_abs and hf_row.mean_abs < wide.mean_abs
    check = LogprobCheck("graph_vs_eager", "float32", base_quant="fp8_block")
    check.add([0.0] * MEAN_MIN_SAMPLES, [5e-3] * MEAN_MIN_SAMPLES, what="w8a16")  # within max, above the mean
    check.add([0.0] * MEAN_MIN_SAMPLES, [3e-3] * MEAN_MIN_SAMPLES, what="e2e-3")
    # the item that contributed most is named: on an fp8 base, one request's large share may be one e4m3
    # crossing, which e2e's locate then names
    with pytest.raises(AssertionError, match=r"mean \|Δlogprob\| 4.000e-03 over 128 logprobs > 3.0e-03 .*"
                                             r"62% of the sum from w8a16\)$"):
        check.finish()
