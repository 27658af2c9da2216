"""GPU only: the reference backend on CUDA in fp32, fp16 and bf16, virtual experts on and off.

Covers: eager deltas and ``moe_forward`` equal the oracle (computed on a CPU copy) with
``torch.cuda.set_sync_debug_mode("error")`` around every delta call. Real CUDA graphs (capture and
replay per family) are in ``test_backend_graphs.py``, parametrised over devices.

Sizes use the ``dev`` caps whatever the profile: the float64 oracle loops over tokens.
"""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES
from moelora_conformance.strategies import moe_lora_cases
from moelora_core import DEFAULT_POLICY
from moelora_reference.backend import make_backend
from moelora_reference.oracle import dense_lora_forward, moe_block_forward

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
    return moe_block_forward(c.x[:rows], c.topk_ids[:rows], c.topk_weights[:rows], c.base,
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
        dense = {}
        for module, W in m.dense_weights.items():
            dense[module] = m.dense_x[module].float() @ W.float().T
            backend.dense_delta(module, m.dense_x[module], dense[module], m.lora, info)
    expected = oracle_on_cpu(m, case.batch.num_tokens)
    close(y, expected, case, "cuda layer harness")
    close(y_fused, expected, case, "cuda moe_forward")
    c = m.to("cpu")
    for module, out in dense.items():
        want = dense_lora_forward(c.dense_x[module], c.dense_weights[module], module, c.lora, c.token_lora_mapping)
        close(out, want, case, f"cuda dense {module}")
