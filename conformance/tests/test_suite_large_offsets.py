"""The ``gpu`` profile's large-offset case: element offsets past 2³¹ in the MoE and dense paths.

Covers, on a CPU (structure only, nothing materialized): the case's ``gate_up_out`` and q output pass
2³¹ elements and the oracle's rows (every request's first and last token) include rows past the
32-bit range on an adapter; the ``gpu`` profile's P01 eager draws include it, its other modes and the
CPU profiles never; the 32-bit-offset mutant is right on every small case (only this case can catch
it). On a GPU (``-m gpu``): the built-in backends and the production-style example pass the case,
the 32-bit-offset mutant fails it.
"""

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings

from moelora_conformance.examples.torch_backend import make_backend as make_production
from moelora_conformance.faulty.beyond_caps import Offsets32Bit
from moelora_conformance.harness import CheckContext, Layer, Oracle, check_run
from moelora_conformance.harness.expected import oracle_row_index
from moelora_conformance.profiles import PROFILES
from moelora_conformance.strategies.large_offsets import TOKENS, large_offset_case, offsets
from moelora_conformance.strategies.suite import suite_cases
from moelora_core.backend import load_backend

LIMIT = 2**31


def test_the_large_offset_case_passes_2_31_in_the_moe_and_dense_outputs():
    case = large_offset_case(torch.bfloat16, seed=3)
    assert case.batch.num_tokens == TOKENS
    far = offsets(case)
    assert far["gate_up_out"] >= LIMIT and far["dense q out"] >= LIMIT, far
    rows = oracle_row_index(case.batch, 16).tolist()
    k, two_i = case.shape.top_k, 2 * case.shape.moe_intermediate_size
    past = [r for r in rows if r * k * two_i >= LIMIT and case.batch.token_lora_mapping[r] >= 0]
    assert TOKENS - 1 in past and len(past) >= 2, rows


def _shape_names(caps, mode, n=200):
    names = []

    @settings(max_examples=n, phases=[Phase.generate], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=suite_cases(caps, mode, torch.bfloat16, virtual_experts=False, large_offsets=True))
    def draw(case):
        names.append(case.shape.name)

    draw()
    return names


def test_the_gpu_profile_draws_the_case_in_eager_items_only():
    # Reachable and rare. Not a count over a fixed run: Hypothesis' generate phase mutates earlier
    # examples and biases integers towards the constants of every loaded module, so the realised
    # share of the 1-in-16 weight moved between 0 and 4 in 200 draws with the set of modules a
    # process had imported (a full `nox -s tests` run drew none).
    gpu = PROFILES["gpu"].caps
    strategy = suite_cases(gpu, "eager", torch.bfloat16, virtual_experts=False, large_offsets=True)
    found = find(strategy, lambda case: case.shape.name == "large-offset",
                 settings=settings(max_examples=2000, database=None, deadline=None, derandomize=True,
                                   suppress_health_check=list(HealthCheck)))
    assert offsets(found)["gate_up_out"] >= LIMIT
    eager = _shape_names(gpu, "eager")
    assert eager.count("large-offset") < len(eager) / 4, eager.count("large-offset")
    assert "large-offset" not in _shape_names(gpu, "decode", 60)
    assert "large-offset" not in _shape_names(PROFILES["interpret"].caps, "eager", 60)


def _check(factory, case, device):
    layer = Layer(factory, case, device)
    inp = layer.inputs()
    run = layer.eager(inp)
    check_run(Oracle(layer, oracle_rows=16), inp, run, layer.disabled(inp, run),
              CheckContext(case.describe(), case.seed, case.dtype, torch.device(device)), "eager")


def test_the_32_bit_offset_mutant_is_right_below_2_31():
    from moelora_conformance.strategies import BatchPlan, LayerShape, MoELoRACase, RoutingPlan, SlotAdapter
    from moelora_conformance.strategies.adapters import pool_ranks, pool_scalings
    from moelora_core import BatchSpec, ForwardMode, Request

    pool = (SlotAdapter(3, 4.0, False, tuple((m, 3, 4.0) for m in ("gate", "up", "down"))),)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(0, 5), Request(-1, 3)], 1, pool_ranks(pool), pool_scalings(pool))
    case = MoELoRACase(LayerShape(hidden_size=8, moe_intermediate_size=8, num_experts=4, num_base_experts=4, top_k=2, dense_shapes=(), max_loras=1, max_rank=4), torch.float32, False, pool,
                       BatchPlan(batch, "extend", "uniform", "small"),
                       RoutingPlan("uniform", 4, 4, 2, False, None, (), 0.0, 2), 2)
    _check(Offsets32Bit, case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tens of GB of device memory)")
@pytest.mark.parametrize("backend", ["reference", "triton", "csgmv", "production"])
def test_backends_pass_the_large_offset_case_on_a_gpu(backend):
    factory = make_production if backend == "production" else load_backend(backend)
    _check(factory, large_offset_case(torch.bfloat16, seed=5), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tens of GB of device memory)")
def test_the_32_bit_offset_mutant_fails_the_large_offset_case_on_a_gpu():
    with pytest.raises(AssertionError):
        _check(Offsets32Bit, large_offset_case(torch.bfloat16, seed=5), "cuda")
