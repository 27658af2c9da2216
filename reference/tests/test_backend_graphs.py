"""The reference backend through moelora's graph API: the host-sync guard around prepare + forward,
and the layer captured once per family and replayed for later batches written in place.

Runs on the CPU emulator always, and on real CUDA graphs where a GPU is present (``gpu`` marker).
Covers: eager and graph-family prepare + the layer harness + ``moe_forward`` + dense deltas pass
``host_sync_guard`` and equal the oracle; a capture on reset (IDLE) metadata, replayed for a drawn
batch, a smaller one and an IDLE one, equals the oracle on live rows and leaves every other row
exactly as the base path computes it.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import DEFAULT_POLICY, BatchSpec, Fallback, ForwardMode
from moelora_core.backend_checks import GraphCapacity
from moelora_core.graphs import graph_pools, host_sync_guard
from moelora_reference.backend import make_backend
from moelora_reference.oracle import dense_lora_forward, moe_block_forward

# The float64 loop oracle runs on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)
DEVICES = [
    pytest.param("cpu", id="cpu-emulated"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                reason="needs CUDA")]),
]


def draw_dtype(data, device):
    options = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    return data.draw(st.sampled_from(options), label="dtype")


def oracle(m, rows):
    c = m.to("cpu")
    return moe_block_forward(c.x[:rows], c.topk_ids[:rows], c.topk_weights[:rows], c.base,
                            c.lora, c.token_lora_mapping[:rows])


def close(actual, expected, case, device, what):
    DEFAULT_POLICY.assert_close(actual, expected, dtype=case.dtype, device=device,
                                what=f"{what} | {case.describe()}", seed=case.seed)


def init(backend, family, batch, slack=0):
    """Initialise ``family`` for ``batch`` (+ slack requests / tokens); returns the token capacity."""
    if family == "decode":
        tpr = batch.tokens_per_request if batch.bs else 1
        backend.init_graph("decode", GraphCapacity.decode(batch.bs + 1 + slack, tpr))
        return (batch.bs + 1 + slack) * tpr
    backend.init_graph("prefill", GraphCapacity.prefill(batch.num_tokens + 1 + slack, batch.bs + 1 + slack))
    return batch.num_tokens + 1 + slack


def static_inputs(m, capacity, seed, device):
    k = m.topk_ids.shape[1]
    gen = torch.Generator(device).manual_seed(seed + 1)
    x = torch.randn(capacity, m.spec.H, generator=gen, device=device).to(m.x.dtype)
    ids = torch.randint(0, m.spec.E, (capacity, k), generator=gen, device=device, dtype=torch.int32)
    w = torch.rand(capacity, k, generator=gen, device=device)
    return x, ids, w


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_prepare_and_forward_pass_the_host_sync_guard(device, data, layer):
    case = data.draw(moe_lora_cases(CAPS, dtype=draw_dtype(data, device)), label="case")
    m, batch = case.materialize(device), case.batch
    backend = make_backend(m.spec)
    families = [None, "prefill"] + (["decode"] if batch.forward_mode is not ForwardMode.EXTEND else [])
    family = data.draw(st.sampled_from(families), label="family")
    T = batch.num_tokens
    if family is None:
        x, ids, w = m.x, m.topk_ids, m.topk_weights
    else:
        x, ids, w = static_inputs(m, init(backend, family, batch), case.seed, device)
        x[:T], ids[:T], w[:T] = m.x, m.topk_ids, m.topk_weights
    dense_in, dense = {}, {}
    for module, W in m.dense_weights.items():  # the caller's inputs and base outputs, made before the guard
        dense_in[module] = torch.zeros(x.shape[0], W.shape[1], dtype=case.dtype, device=device)
        dense_in[module][:T] = m.dense_x[module]
        dense[module] = dense_in[module].float() @ W.float().T
    with host_sync_guard(device):
        info = backend.prepare(batch, family)
        y = layer(backend, m, info, x, ids, w)
        y_fused = backend.moe_forward(x, ids, w, m.base, m.lora, info)
        for module, out in dense.items():
            backend.dense_delta(module, dense_in[module], out, m.lora, info)
    expected = oracle(m, T)
    close(y[:T], expected, case, device, f"guarded layer ({family or 'eager'})")
    close(y_fused[:T], expected, case, device, f"guarded moe_forward ({family or 'eager'})")
    cpu = m.to("cpu")
    for module, out in dense.items():
        want = dense_lora_forward(cpu.dense_x[module], cpu.dense_weights[module], module, cpu.lora,
                                  cpu.token_lora_mapping)
        close(out[:T], want, case, device, f"guarded dense {module}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["prefill", "decode"])
@given(data=st.data())
def test_captured_layer_replays_later_batches(device, family, data, layer):
    kinds = ("decode",) if family == "decode" else ("extend", "mixed", "decode")
    case = data.draw(moe_lora_cases(CAPS, kinds=kinds, dtype=draw_dtype(data, device)), label="case")
    m, big = case.materialize(device), case.batch
    n = data.draw(st.integers(1, big.bs), label="requests in the second batch")
    small = BatchSpec(big.forward_mode, big.requests[:n], big.max_loras, big.lora_ranks, big.scalings)
    idle = BatchSpec(ForwardMode.IDLE, [], big.max_loras, big.lora_ranks, big.scalings)
    backend = make_backend(m.spec)
    cap = init(backend, family, big, slack=data.draw(st.integers(0, 3), label="capacity slack"))
    x, ids, w = static_inputs(m, cap, case.seed, device)
    info = backend.prepare(idle, family)  # capture on reset metadata; has_active_lora is True
    graph = graph_pools(device)[family].capture(lambda: layer(backend, m, info, x, ids, w))
    for batch in (big, small, idle):
        assert not isinstance(backend.prepare(batch, family), Fallback)  # writes the captured buffers in place
        rows = batch.num_tokens
        x[:rows], ids[:rows], w[:rows] = m.x[:rows], m.topk_ids[:rows], m.topk_weights[:rows]
        y = graph.replay()
        if rows:
            close(y[:rows], oracle(m, rows), case, device, f"{family} replay, {batch.bs} requests")
        base = layer(backend, m, info, x, ids, w, lora=False)
        assert torch.equal(y[rows:], base[rows:]), f"rows past the live count picked up LoRA ({batch.bs} requests)"
