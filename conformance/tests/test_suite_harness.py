"""The harness and its checks, on their own: each check passes on a right answer and fails on a
wrong one (a check that cannot fail would let every backend through).

Covers: the delta check (exact deltas pass; a delta 0.1 % off fails in fp32; fp16 output rounding
is allowed, a real fp16 error is not; NaN fails); the bitwise check (one ulp fails); the standard
run checks on the reference (eager and each graph mode) and their failure on a base row nudged by
one ulp and on a pad row that picked up LoRA; the metadata checks on the reference's metadata, and
their failure on a stale tail, a lost token, a wrong per-request field, a launch count that misses
segments and a segment longer than ``max_len``; the break op (live and
static maps agree with the float64 twin); ``BatchInputs.select`` keeps rows with their request.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moelora_conformance.harness import CheckContext, GraphLayer, Layer, Oracle, check_run
from moelora_conformance.harness.break_op import LiveRequests, StaticRequests, break_op_f64
from moelora_conformance.harness.checks import accumulation_bound, assert_bitwise, assert_delta_close
from moelora_conformance.harness.metadata import check_batch_metadata, check_segments
from moelora_conformance.profiles import PROFILES
from moelora_conformance.strategies import (
    BatchPlan,
    LayerShape,
    MoELoRACase,
    RoutingPlan,
    SlotAdapter,
    moe_lora_cases,
)
from moelora_core import DEFAULT_POLICY, BatchSpec, ForwardMode, LoRALayerSpec, Request
from moelora_reference.backend import make_backend

CAPS = PROFILES["interpret"].caps
CPU = torch.device("cpu")


def ctx(dtype=torch.float32):
    return CheckContext("unit", 0, dtype, CPU)


def test_delta_check_passes_exact_and_fails_a_small_error():
    g = torch.Generator().manual_seed(1)
    base, delta = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g, dtype=torch.float64)
    lora = base.double() + delta
    assert_delta_close(lora, base, delta, ctx(), "exact")
    with pytest.raises(AssertionError, match="LoRA delta"):
        assert_delta_close(lora + 1e-3 * delta.abs().max(), base, delta, ctx(), "0.1 % off")
    with pytest.raises(AssertionError):
        assert_delta_close(torch.full_like(lora, float("nan")), base, delta, ctx(), "NaN")


def test_delta_check_allows_output_rounding_but_not_more():
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(64, 32, generator=g) * 50).half()  # large outputs, small deltas: rounding dominates
    delta = torch.randn(64, 32, generator=g, dtype=torch.float64) * 0.05
    lora = (base.double() + delta).half()
    c = ctx(torch.float16)
    with pytest.raises(AssertionError):
        assert_delta_close(lora, base, delta, c, "no allowance")
    assert_delta_close(lora, base, delta, c, "allowance", rounded=(lora,))
    with pytest.raises(AssertionError):
        assert_delta_close((lora.double() + 0.2 * delta).half(), base, delta, c, "wrong delta", rounded=(lora,))


def _rank_one_delta_fp32(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sigma: float) -> torch.Tensor:
    """σ·b(a·x) the way a kernel may compute it: a left-to-right fp32 sum, then the expand."""
    acc = torch.zeros((), dtype=torch.float32)
    for xi, ai in zip(x.tolist(), a.tolist(), strict=True):
        acc = acc + torch.tensor(xi, dtype=torch.float32) * torch.tensor(ai, dtype=torch.float32)
    return (acc * b * torch.tensor(sigma, dtype=torch.float32)).float()


def test_delta_check_allows_the_fp32_accumulation_error_of_an_ill_conditioned_rank_one_delta():
    # CI (2026-11-29) on the inspecting backend: a rank-1 dense q delta of one decode token, H=41,
    # failed at max_rel 2.7e-5 (> 1e-5): a·x had cancelled, and the fp32 sum's rounding, which a
    # correct kernel makes, was larger than 1e-5 of the tiny delta.
    g = torch.Generator().manual_seed(7)
    H, out, sigma = 41, 64, 4 / 3
    x = torch.randn(H, generator=g)
    a = torch.randn(H, generator=g)
    # make a·x cancel to about 1e-4 of Σ|a_i x_i|
    a[-1] = float(-(x[:-1].double() @ a[:-1].double()) / x[-1].double()) + 1e-4 * float((x * a).abs().sum()) / float(
        x[-1]
    )
    b = torch.randn(out, generator=g)
    expected = sigma * float(a.double() @ x.double()) * b.double()
    actual = _rank_one_delta_fp32(x, a, b, sigma)
    base = torch.zeros(out)
    magnitude = sigma * float(a.double().abs() @ x.double().abs()) * b.double().abs()
    allowed = accumulation_bound(magnitude, H + 1 + 2)
    c = ctx()
    with pytest.raises(AssertionError, match="LoRA delta"):  # the case is real: 1e-5 alone rejects it
        assert_delta_close(actual[None], base[None], expected[None], c, "no accumulation allowance")
    assert_delta_close(actual[None], base[None], expected[None], c, "fp32 accumulation", accumulation=allowed[None])
    wrong_sigma = _rank_one_delta_fp32(x, a, b, 1.0)  # σ = α/r read as 1: still caught
    with pytest.raises(AssertionError, match="fp32 accumulation allowance on"):
        assert_delta_close(wrong_sigma[None], base[None], expected[None], c, "σ = 1", accumulation=allowed[None])


def test_accumulation_allowance_still_rejects_small_errors_of_a_well_conditioned_delta():
    g = torch.Generator().manual_seed(8)
    T, H, R, out = 4, 64, 16, 48
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    A = torch.randn(R, H, generator=g, dtype=torch.float64)
    B = torch.randn(out, R, generator=g, dtype=torch.float64)
    expected = (x @ A.T) @ B.T
    allowed = accumulation_bound((x.abs() @ A.abs().T) @ B.abs().T, H + R + 2)
    assert_delta_close(expected.float(), torch.zeros(T, out), expected, ctx(), "fp32 result", accumulation=allowed)
    with pytest.raises(AssertionError, match="LoRA delta"):
        assert_delta_close(
            (expected * (1 + 1e-4)).float(), torch.zeros(T, out), expected, ctx(), "1e-4 off", accumulation=allowed
        )
    with pytest.raises(ValueError, match="accumulation depth"):
        accumulation_bound(expected, 0)


def test_bitwise_check_fails_on_one_ulp():
    t = torch.randn(4, 4)
    nudged = t.clone()
    nudged[2, 3] = torch.nextafter(t[2, 3], torch.tensor(float("inf")))
    assert_bitwise(t, t.clone(), ctx(), "same")
    with pytest.raises(AssertionError, match="1 of 16 elements differ bitwise"):
        assert_bitwise(nudged, t, ctx(), "one ulp")


def _mixed_batch_case(data, kinds=("extend",)):
    case = data.draw(
        moe_lora_cases(CAPS, kinds=kinds, adapter_modes=("alternating",), dtype=torch.float32), label="case"
    )
    return case


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_run_checks_pass_on_the_reference_and_fail_on_a_nudged_base_row(data):
    case = _mixed_batch_case(data)
    layer = Layer(make_backend, case, CPU)
    inp = layer.inputs()
    run = layer.eager(inp)
    base = layer.disabled(inp, run)
    oracle, c = Oracle(layer), CheckContext(case.describe(), case.seed, case.dtype, CPU)
    check_run(oracle, inp, run, base, c, "eager")
    rows = [t for t, s in enumerate(case.batch.token_lora_mapping) if s < 0]
    if rows:
        bad = dataclasses.replace(run, y=run.y.clone())
        bad.y[rows[0], 0] = torch.nextafter(bad.y[rows[0], 0], torch.tensor(float("inf")))
        with pytest.raises(AssertionError, match="base rows"):
            check_run(oracle, inp, bad, base, c, "nudged", outputs=False, deltas=False)


@pytest.mark.parametrize("mode", ["decode", "prefill-full", "prefill-breakable"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_graph_runs_pass_and_a_pad_row_with_lora_fails(mode, data):
    kinds = ("decode",) if mode == "decode" else ("extend", "mixed")
    case = _mixed_batch_case(data, kinds)
    b = case.batch
    tpr = b.tokens_per_request if mode == "decode" else 1
    layer = Layer(make_backend, case, CPU)
    graph = GraphLayer(layer, mode, max_requests=b.bs + 2, max_tokens=b.num_tokens + 7, tokens_per_request=tpr)
    inp = layer.inputs()
    run = graph.run(inp)
    base = graph.disabled(run)
    oracle, c = Oracle(layer), CheckContext(case.describe(), case.seed, case.dtype, CPU)
    check_run(oracle, inp, run, base, c, mode, pad_rows=True)
    assert graph.captures == 1
    graph.run(inp)
    assert graph.captures == 1  # captured once, replayed after
    full_y = run.rows["y"].clone()
    full_y[-1] += 1.0  # a pad row that picked up something
    bad = dataclasses.replace(run, rows={**run.rows, "y": full_y})
    with pytest.raises(AssertionError, match="pad rows"):
        check_run(oracle, inp, bad, base, c, mode, outputs=False, deltas=False, base_rows=False, pad_rows=True)


def _pool_batch(slots, lens, L=3, ranks=(2, 0, 4)):
    return BatchSpec(ForwardMode.EXTEND, [Request(s, n) for s, n in zip(slots, lens)], L, ranks, (1.0, 0.0, 0.5))


def _spec():
    return LoRALayerSpec(
        hidden_size=8, moe_intermediate_size=8, num_experts=4, top_k=2, dense_shapes={}, max_loras=3, max_rank=4
    )


def test_metadata_checks_pass_on_the_reference_and_fail_on_faults():
    backend = make_backend(_spec())
    big, small = _pool_batch([0, -1, 2, 1], [3, 1, 2, 2]), _pool_batch([2, 0], [1, 2])
    info = backend.prepare(small)
    check_batch_metadata(info, small, ctx(), graph=False, num_experts=4, max_loras=3)
    backend.init_prefill_graph(12, 6)
    backend.prepare(big, "prefill")
    info = backend.prepare(small, "prefill")
    check_batch_metadata(info, small, ctx(), graph=True, num_experts=4, max_loras=3)
    stale = dataclasses.replace(
        info, moe=dataclasses.replace(info.moe, token_lora_mapping=info.moe.token_lora_mapping.clone())
    )
    stale.moe.token_lora_mapping[5] = 1  # a tail entry left from the larger batch
    with pytest.raises(AssertionError, match="token_lora_mapping"):
        check_batch_metadata(stale, small, ctx(), graph=True, num_experts=4, max_loras=3)
    wrong = dataclasses.replace(info, req_weight_indices=info.req_weight_indices.clone())
    wrong.req_weight_indices[0] = 0
    with pytest.raises(AssertionError, match="req_weight_indices"):
        check_batch_metadata(wrong, small, ctx(), graph=True, num_experts=4, max_loras=3)
    lost = dataclasses.replace(info, weight_indices=info.weight_indices.clone())
    lost.weight_indices[1] = -1  # the slot-0 request's tokens lie in no adapter segment
    with pytest.raises(AssertionError, match="lies in 0 segments"):
        check_segments(lost, small, ctx())
    eager = backend.prepare(big)
    check_segments(eager, big, ctx())
    with pytest.raises(AssertionError, match="past num_segments"):  # a launch count frozen on a smaller batch
        check_segments(dataclasses.replace(eager, num_segments=1), big, ctx())
    with pytest.raises(AssertionError, match="> max_len"):
        check_segments(dataclasses.replace(eager, max_len=2), big, ctx())


def test_break_op_live_and_static_agree_with_the_float64_twin():
    g = torch.Generator().manual_seed(3)
    batch = _pool_batch([0, -1, 2], [3, 1, 2])
    T, cap = batch.num_tokens, 9
    x = torch.randn(cap, 5, generator=g)
    dense = {"q": torch.randn(cap, 7, generator=g), "o": torch.randn(cap, 5, generator=g)}
    live, static = LiveRequests(CPU, cap), StaticRequests(CPU, cap, max_requests=4)
    live.set_batch(batch)
    static.set_batch(batch)
    want = break_op_f64(x[:T], {k: v[:T] for k, v in dense.items()}, batch)
    for name, out in (("live", live(x, dense)), ("static", static(x, dense))):
        DEFAULT_POLICY.assert_close(out[:T], want, dtype=torch.float32, what=f"{name} break op")
    # each token's factor comes from its own request only
    moved = {k: v.clone() for k, v in dense.items()}
    moved["q"][3] += 10.0  # token 3 is request 1's only token
    out = live(x, moved)
    assert torch.equal(out[:3], live(x, dense)[:3]) and not torch.equal(out[3], live(x, dense)[3])


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_select_keeps_rows_with_their_request(data):
    case = data.draw(moe_lora_cases(CAPS, kinds=("extend", "mixed")), label="case")
    layer = Layer(make_backend, case, CPU)
    inp = layer.inputs()
    order = data.draw(st.permutations(range(case.batch.bs)), label="order")
    part = inp.select(order)
    starts = case.batch.req_seg_indptr
    row = 0
    for q in order:
        n = starts[q + 1] - starts[q]
        assert torch.equal(part.x[row : row + n], inp.x[starts[q] : starts[q + 1]])
        assert part.batch.requests[order.index(q)] == case.batch.requests[q]
        row += n
    assert part.batch.num_tokens == case.batch.num_tokens


def test_a_dense_only_adapter_has_no_moe_delta_regression():
    # Found while building the harness: an adapter with only a v module changes the MoE input (through
    # the break op) by ~1e-4, and comparing "y - y(LoRA-disabled run)" against the oracle's MoE delta
    # charged fp32 noise of the whole base MoE to a delta of that size (max_rel 3.7e-5 > 1e-5). The
    # twin now runs the MoE on the run's own MoE input: the MoE delta of this adapter is exactly zero.
    shape = LayerShape(4, 4, 1, 1, 1, (("q", (4, 4)), ("k", (4, 4)), ("v", (4, 4)), ("o", (4, 4))), 1, 1)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(0, 1)], 1, (1,), (1.0,))
    case = MoELoRACase(
        shape,
        torch.float32,
        False,
        (SlotAdapter(1, 1.0, False, (("v", 1, 1.0),)),),
        BatchPlan(batch, "extend", "uniform", "small"),
        RoutingPlan("uniform", 1, 1, 1, False, None, (), 0.0, 0),
        0,
    )
    for path in ("deltas", "fused"):
        layer = Layer(make_backend, case, CPU, moe_path=path)
        graph = GraphLayer(layer, "prefill-full", max_requests=1, max_tokens=1)
        inp = layer.inputs()
        c = CheckContext(case.describe(), case.seed, case.dtype, CPU)
        for run, base in ((layer.eager(inp), None), (graph.run(inp), "graph")):
            twin = layer.disabled(inp, run) if base is None else graph.disabled(run)
            assert torch.equal(run.y, twin.y), path
            check_run(Oracle(layer), inp, run, twin, c, f"{path} {base or 'eager'}", pad_rows=base is not None)
