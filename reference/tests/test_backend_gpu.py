"""GPU only: the reference backend on CUDA, bf16 included, with real CUDA graphs.

Covers: eager deltas and ``moe_forward`` equal the oracle (computed on a CPU copy) in fp32, fp16
and bf16, with ``torch.cuda.set_sync_debug_mode("error")`` around every delta call; the layer
captured once per graph family in a ``torch.cuda.CUDAGraph`` and replayed for a large batch and
then a smaller one (written in place by ``prepare``) equals the oracle on live rows, and rows past
the live count equal the base path bit for bit.

Sizes use the ``dev`` caps whatever the profile: the float64 oracle loops over tokens.
"""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES
from moelora_conformance.strategies import moe_lora_cases
from moelora_core import DEFAULT_POLICY, BatchSpec, Fallback, ForwardMode
from moelora_reference.backend import make_backend
from moelora_reference.oracle import moe_lora_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CAPS = PROFILES["dev"].caps
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@contextlib.contextmanager
def sync_debug_error():
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def oracle_on_cpu(m, rows):
    c = m.to("cpu")
    return moe_lora_forward(c.x[:rows], c.topk_ids[:rows], c.topk_weights[:rows], c.base.w_gate_up, c.base.w_down,
                            c.lora, c.token_lora_mapping[:rows])


def close(actual, expected, case, what):
    DEFAULT_POLICY.assert_close(actual, expected, dtype=case.dtype, device="cuda",
                                what=f"{what} | {case.describe()}", seed=case.seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("virtual", [False, True], ids=["direct", "virtual"])
@given(data=st.data())
def test_cuda_eager_equals_oracle_without_host_syncs(dtype, virtual, data, layer):
    case = data.draw(moe_lora_cases(CAPS, dtype=dtype, virtual_experts=virtual), label="case")
    m = case.materialize("cuda")
    backend = make_backend(m.spec)
    info = backend.prepare(case.batch)
    with sync_debug_error():
        y = layer(backend, m, info, m.x, m.topk_ids, m.topk_weights)
        y_fused = backend.moe_forward(m.x, m.topk_ids, m.topk_weights, m.base, m.lora, info)
        for module, W in m.dense_weights.items():
            out = m.dense_x[module].float() @ W.float().T
            backend.dense_delta(module, m.dense_x[module], out, m.lora, info)
    expected = oracle_on_cpu(m, case.batch.num_tokens)
    close(y, expected, case, "cuda layer harness")
    close(y_fused, expected, case, "cuda moe_forward")


@pytest.mark.parametrize("family", ["prefill", "decode"])
@given(data=st.data())
def test_cuda_graph_replay_of_later_batches_equals_oracle(family, data, layer):
    kinds = ("decode",) if family == "decode" else ("extend", "mixed", "decode")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    case = data.draw(moe_lora_cases(CAPS, kinds=kinds, dtype=dtype), label="case")
    m, big = case.materialize("cuda"), case.batch
    n = data.draw(st.integers(1, big.bs), label="requests in the second batch")
    small = BatchSpec(big.forward_mode, big.requests[:n], big.max_loras, big.lora_ranks, big.scalings)
    backend = make_backend(m.spec)
    if family == "decode":
        backend.init_decode_graph(big.bs + 1, big.tokens_per_request)
        cap = (big.bs + 1) * big.tokens_per_request
    else:
        cap = big.num_tokens + 5
        backend.init_prefill_graph(cap, big.bs + 1)
    k = m.topk_ids.shape[1]
    gen = torch.Generator("cuda").manual_seed(case.seed + 1)
    x = torch.randn(cap, m.spec.H, generator=gen, device="cuda").to(dtype)
    ids = torch.randint(0, m.spec.E, (cap, k), generator=gen, device="cuda", dtype=torch.int32)
    w = torch.rand(cap, k, generator=gen, device="cuda")
    idle = BatchSpec(ForwardMode.IDLE, [], big.max_loras, big.lora_ranks, big.scalings)
    info = backend.prepare(idle, family)  # capture on reset metadata; has_active_lora is True
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(backend, m, info, x, ids, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(backend, m, info, x, ids, w)
    for batch in (big, small):
        assert not isinstance(backend.prepare(batch, family), Fallback)  # writes the captured buffers
        rows = batch.num_tokens
        x[:rows], ids[:rows], w[:rows] = m.x[:rows], m.topk_ids[:rows], m.topk_weights[:rows]
        graph.replay()
        torch.cuda.synchronize()
        close(y[:rows], oracle_on_cpu(m, rows), case, f"{family} graph replay, {batch.bs} requests")
        base = layer(backend, m, info, x, ids, w, lora=False)
        assert torch.equal(y[rows:], base[rows:]), "rows past the live count picked up LoRA"
