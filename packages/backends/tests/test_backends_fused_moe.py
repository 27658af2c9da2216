"""``triton-fused`` (``moelora_backends.triton_backend:make_fused_backend``): ``triton`` declaring
``fused_moe``, whose ``moe_forward`` runs the MoE layer with the deltas fused into the base GEMMs
(under the interpreter).

Covers: the capability declared (and ``triton`` still without it, its ``moe_forward`` refused); on
strategy-drawn cases (fp16; sentinel ids, extra base experts, mixed ranks, every expert layout,
decode and extend) ``moe_forward`` equals the oracle under the host-sync guard, the pool unchanged;
the suite's own checks of P01 on the harness's ``fused`` path (outputs and deltas vs the oracle),
eagerly in fp32 and captured in the decode graph family in fp16; base rows bit-identical to its own LoRA-disabled
run (all-base metadata of the same batch, the suite's P02 on the fused path): on hand-built
routing where base tokens have experts of their own on the CPU (numpy's matmul rounds a row by its
place in the tile), on every drawn case on a GPU; an IDLE batch; base weights of another shape or
dtype refused.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moelora_backends.triton_backend import TritonFusedBackend, make_backend, make_fused_backend
from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import (
    DEFAULT_POLICY,
    BatchSpec,
    ForwardMode,
    InvalidFieldError,
    LoRALayerSpec,
    LoRAWeights,
    ModuleLoRA,
    MoEBaseWeights,
    Request,
    load_backend,
)
from moelora_core.graphs import host_sync_guard
from moelora_reference.oracle import moe_block_forward

pytestmark = pytest.mark.interpreter
ON_GPU = torch.cuda.is_available()
# the fp64 loop oracle cannot follow the gpu profile's sizes
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _all_base(batch):
    return BatchSpec(batch.forward_mode, [Request(-1, r.extend_len) for r in batch.requests], batch.max_loras,
                     batch.lora_ranks, batch.scalings)


def test_declares_fused_moe_and_triton_does_not():
    assert load_backend("moelora_backends.triton_backend:make_fused_backend") is make_fused_backend
    spec = LoRALayerSpec(hidden_size=16, moe_intermediate_size=8, num_experts=2, top_k=1, dense_shapes={},
                         max_loras=1, max_rank=4, dtype=torch.float32)
    fused, plain = make_fused_backend(spec), make_backend(spec)
    assert isinstance(fused, TritonFusedBackend) and fused.name == "triton-fused"
    assert fused.capabilities().fused_moe and not plain.capabilities().fused_moe
    weights = LoRAWeights(spec)
    info = plain.prepare(BatchSpec(ForwardMode.EXTEND, [Request(-1, 2)], 1, [0], [0.0]))
    base = MoEBaseWeights(w_gate_up=torch.randn(2, 16, 16), w_down=torch.randn(2, 16, 8))
    with pytest.raises(InvalidFieldError, match="fused_moe"):
        plain.moe_forward(torch.randn(2, 16), torch.zeros(2, 1, dtype=torch.int32), torch.rand(2, 1), base, weights,
                          info)


# fp16 here, fp32 through the harness below; a few examples: the fp64 loop oracle costs ~3 s one
@settings(max_examples=max(1, current_profile().max_examples // 5))
@given(data=st.data())
def test_moe_forward_equals_the_oracle(data):
    dtype = torch.float16
    case = data.draw(moe_lora_cases(CAPS, dtype=dtype, virtual_experts=False, kinds=("extend", "decode", "mixed")),
                     label="case")
    m = case.materialize()
    backend = make_fused_backend(m.spec)
    info = backend.prepare(case.batch)
    pool = {name: m.lora.storage(name).clone() for name in ("gate_up_A", "gate_up_B", "down_A", "down_B")}
    with host_sync_guard(m.x.device):
        y = backend.moe_forward(m.x, m.topk_ids, m.topk_weights, m.base, m.lora, info)
    want = moe_block_forward(m.x, m.topk_ids, m.topk_weights, m.base, m.lora, m.token_lora_mapping)
    DEFAULT_POLICY.assert_close(y, want, dtype=dtype, what=f"moe_forward | {case.describe()}", seed=case.seed)
    assert y.dtype == m.x.dtype
    assert all(torch.equal(m.lora.storage(n), t) for n, t in pool.items()), "moe_forward wrote the pool"
    if ON_GPU:  # on the CPU numpy's matmul rounds a row by its place in the tile
        off = backend.moe_forward(m.x, m.topk_ids, m.topk_weights, m.base, m.lora,
                                  backend.prepare(_all_base(case.batch)))
        rows = m.token_lora_mapping == -1
        assert torch.equal(_bits(y[rows]), _bits(off[rows])), "base rows vs the LoRA-disabled run"


H, I, E, K, L, R = 24, 16, 4, 2, 3, 8  # noqa: E741


def _hand_built(dtype):
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K, dense_shapes={},
                         max_loras=L, max_rank=R, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    weights = LoRAWeights(spec)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    for slot, r, sigma in ((0, 8, 0.5), (2, 3, 2.0)):  # slot 1 stays empty (rank 0)
        weights.load_slot(slot, {mod: ModuleLoRA(rnd(E, r, fin), rnd(E, fout, r), sigma)
                                 for mod, (fin, fout) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)))})
    base = MoEBaseWeights(w_gate_up=rnd(E + 1, 2 * I, H).to(dtype), w_down=rnd(E + 1, H, I).to(dtype),
                          num_experts=E)
    return spec, weights, base, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_base_rows_bit_identical_to_its_lora_disabled_run(dtype):
    # base requests route to experts 0 and E (an extra base expert), adapter requests to 1-3: the
    # base tokens' blocks hold the same rows in both runs, so even numpy's matmul gives equal bits
    spec, weights, base, gen = _hand_built(dtype)
    reqs = [Request(0, 5), Request(-1, 3), Request(2, 1), Request(1, 2), Request(-1, 4), Request(2, 7)]
    batch = BatchSpec(ForwardMode.EXTEND, reqs, L, weights.slot_ranks(), weights.slot_scalings())
    mapping = torch.tensor(batch.token_lora_mapping, dtype=torch.int32)
    T = batch.num_tokens
    ids = torch.stack([torch.tensor([0, E]) if s < 0 else 1 + torch.randperm(3, generator=gen)[:K]
                       for s in mapping.tolist()]).to(torch.int32)
    x, w = torch.randn(T, H, generator=gen).to(dtype), torch.rand(T, K, generator=gen)
    backend = make_fused_backend(spec)
    y = backend.moe_forward(x, ids, w, base, weights, backend.prepare(batch))
    off = backend.moe_forward(x, ids, w, base, weights, backend.prepare(_all_base(batch)))
    rows = mapping < 0
    assert torch.equal(_bits(y[rows]), _bits(off[rows])), "base rows vs the LoRA-disabled run"
    want = moe_block_forward(x, ids, w, base, weights, mapping)
    DEFAULT_POLICY.assert_close(y, want, dtype=dtype, what="moe_forward")
    assert not torch.equal(y[~rows], off[~rows]), "adapter rows got no delta"


def test_idle_batch_and_bad_base_weights():
    spec, weights, base, _ = _hand_built(torch.float32)
    backend = make_fused_backend(spec)
    idle = backend.prepare(BatchSpec(ForwardMode.IDLE, [], L, weights.slot_ranks(), weights.slot_scalings()))
    y = backend.moe_forward(torch.empty(0, H), torch.empty(0, K, dtype=torch.int32), torch.empty(0, K), base,
                            weights, idle)
    assert y.shape == (0, H)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(0, 3)], L, weights.slot_ranks(), weights.slot_scalings())
    info = backend.prepare(batch)
    x, ids, w = torch.randn(3, H), torch.zeros(3, K, dtype=torch.int32), torch.rand(3, K)
    narrow = MoEBaseWeights(w_gate_up=base.w_gate_up[:, :, :H - 1].contiguous(), w_down=base.w_down[:, :H - 1],
                            num_experts=E)
    with pytest.raises(InvalidFieldError, match="base_weights"):
        backend.moe_forward(x, ids, w, narrow, weights, info)
    half = MoEBaseWeights(w_gate_up=base.w_gate_up.half(), w_down=base.w_down.half(), num_experts=E)
    with pytest.raises(InvalidFieldError, match="base_weights"):
        backend.moe_forward(x, ids, w, half, weights, info)


# --- the suite's own fused-path checks (the layer harness on moe_path="fused") ----------------------


def _suite():
    from moelora_conformance.properties.support import Suite
    from moelora_conformance.strategies.suite import suite_caps

    profile = current_profile()
    caps = make_fused_backend(LoRALayerSpec(hidden_size=8, moe_intermediate_size=8, num_experts=2, top_k=1,
                                            dense_shapes={}, max_loras=1, max_rank=1,
                                            dtype=torch.float32)).capabilities()
    return Suite(target="moelora_backends.triton_backend:make_fused_backend", factory=make_fused_backend,
                 name="triton-fused", version="test", capabilities=caps, device=torch.device("cpu"),
                 profile=profile, caps=suite_caps(capped(profile.caps, PROFILES["dev"].caps), caps))


@pytest.mark.parametrize("mode, dtype", [("eager", torch.float32), ("decode", torch.float16)])
@settings(max_examples=2)
@given(data=st.data())
def test_the_suites_fused_path_checks_pass(mode, dtype, data):
    # P01's checks (outputs and deltas vs the oracle; graph mode: captured, replayed) on the fused
    # path; base and pad rows vs the LoRA-disabled run bit for bit on a GPU only (numpy, above)
    from moelora_conformance.harness.expected import check_run
    from moelora_conformance.properties.support import Subject, draw_capacity, draw_case

    suite = _suite()
    case = draw_case(data, suite, mode, dtype)
    subject = Subject(suite, case, mode, "fused", draw_capacity(data, mode, [case.batch]))
    inp = subject.inputs()
    run = subject.run(inp)
    graph = subject.graph is not None and run.fallback is None
    check_run(subject.oracle, inp, run, subject.disabled(inp, run), subject.ctx, f"{mode} fused", base_rows=ON_GPU,
              pad_rows=graph and ON_GPU)
