"""The reference backend against the readable oracle, eagerly and through each graph family.

Covers: every capability declared and the protocol satisfied; on strategy-drawn cases (fp32 and
fp16, virtual experts on and off): the layer harness and ``moe_forward`` equal the oracle, dense
deltas equal the oracle, base rows are bit-identical to a LoRA-disabled run, all under a host-sync
guard; the same through the prefill and decode families' static buffers with activations padded to
capacity (pad rows add nothing); a small batch after a larger one equals a fresh eager run with
every tail reset, in the whole family or in a smaller bucket's views of its buffers; over capacity
returns Fallback leaving every static buffer unchanged, and the eager run is right; static buffers keep their addresses and the families share no storage; an inactive
eager batch leaves NaN-poisoned outputs untouched; bad calls raise clear errors.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES, current_profile
from moelora_conformance.strategies import capped, moe_lora_cases
from moelora_core import (
    DEFAULT_POLICY,
    Backend,
    BatchSpec,
    Fallback,
    ForwardMode,
    HostSyncError,
    InvalidFieldError,
    LoRALayerSpec,
    LoRAWeights,
    ModuleLoRA,
    Request,
    assert_exact,
    load_backend,
)
from moelora_core.backend import check_protocol
from moelora_core.backend_checks import GraphCapacity
from moelora_core.errors import RenamedError
from moelora_reference.backend import ReferenceBackend, make_backend
from moelora_reference.oracle import dense_lora_forward, moe_block_forward

F32, F16 = torch.float32, torch.float16


# The float64 loop oracle and the loop twins run on the CPU: bound the sizes whatever the profile.
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)


def oracle(m, mapping=None, rows=None):
    rows = slice(None) if rows is None else slice(0, rows)
    mapping = m.token_lora_mapping if mapping is None else mapping
    return moe_block_forward(m.x[rows], m.topk_ids[rows], m.topk_weights[rows], m.base,
                            m.lora, mapping)


def close(actual, expected, case, what):
    DEFAULT_POLICY.assert_close(actual, expected, dtype=case.dtype, what=f"{what} | {case.describe()}",
                                seed=case.seed)


def bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_identical(actual, expected, what):
    same = bits(actual) == bits(expected)
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} elements differ bitwise; first at {idx}")


def padded_inputs(m, capacity, seed):
    """x, topk_ids, topk_weights padded to ``capacity`` rows with fresh random values and valid ids
    (a stale mapping would make those rows pick up LoRA)."""
    T, k = m.topk_ids.shape
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(capacity, m.spec.H, generator=gen).to(m.x.dtype)
    ids = torch.randint(0, m.spec.E, (capacity, k), generator=gen, dtype=torch.int32)
    w = torch.rand(capacity, k, generator=gen)
    x[:T], ids[:T], w[:T] = m.x, m.topk_ids, m.topk_weights
    return x, ids, w


def check_dense(backend, m, info, case, guard, rows):
    """Dense deltas equal the oracle on the live rows; rows mapped to -1 stay bit-identical."""
    T = m.x.shape[0]
    mapping = info.token_lora_mapping
    for module, W in m.dense_weights.items():
        xin = torch.zeros(rows, W.shape[1], dtype=case.dtype)
        xin[:T] = m.dense_x[module]
        base = xin.float() @ W.float().T  # fp32: the comparison sees the delta's rounding only
        out = base.clone()
        with guard():
            backend.dense_delta(module, xin, out, m.lora, info)
        close(out[:T], dense_lora_forward(m.dense_x[module], W, module, m.lora, m.token_lora_mapping), case,
              f"dense {module}")
        assert_bit_identical(out[mapping == -1], base[mapping == -1], f"dense {module} base rows")
        low = base.to(case.dtype)  # and in the activation dtype
        out = low.clone()
        backend.dense_delta(module, xin, out, m.lora, info)
        assert_bit_identical(out[mapping == -1], low[mapping == -1], f"dense {module} base rows ({case.dtype})")


def test_declares_every_capability_and_satisfies_the_protocol():
    assert load_backend("reference") is make_backend
    backend = make_backend(small_spec())
    assert isinstance(backend, Backend) and isinstance(backend, ReferenceBackend)
    caps = backend.capabilities()
    assert caps.dtypes == {torch.float32, torch.float16, torch.bfloat16}
    assert caps.devices == {"cpu", "cuda"}
    assert caps.graph_families == {"decode", "prefill"}
    assert caps.prefill_graph_modes == {"full", "breakable"}
    assert caps.virtual_experts and caps.fused_moe
    assert caps.max_rank is None and caps.max_requests is None
    assert backend.name == "reference" and backend.version


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("virtual", [False, True], ids=["direct", "virtual"])
@given(data=st.data())
def test_eager_equals_oracle_and_base_rows_are_untouched(dtype, virtual, data, guard, layer):
    case = data.draw(moe_lora_cases(CAPS, dtype=dtype, virtual_experts=virtual), label="case")
    m = case.materialize()
    backend = make_backend(m.spec)
    info = backend.prepare(case.batch)
    assert not info.use_cuda_graph and info.has_active_lora == case.batch.has_active_lora
    with guard():
        y = layer(backend, m, info, m.x, m.topk_ids, m.topk_weights)
        y_fused = backend.moe_forward(m.x, m.topk_ids, m.topk_weights, m.base, m.lora, info)
    expected = oracle(m)
    close(y, expected, case, "layer harness")
    close(y_fused, expected, case, "moe_forward")
    base = layer(backend, m, info, m.x, m.topk_ids, m.topk_weights, lora=False)
    rows = m.token_lora_mapping == -1
    assert_bit_identical(y[rows], base[rows], "base rows vs LoRA disabled")
    off = backend.prepare(BatchSpec(case.batch.forward_mode, [Request(-1, r.extend_len) for r in case.batch.requests],
                                    case.batch.max_loras, case.batch.lora_ranks, case.batch.scalings))
    fused_base = backend.moe_forward(m.x, m.topk_ids, m.topk_weights, m.base, m.lora, off)
    assert_bit_identical(y_fused[rows], fused_base[rows], "moe_forward base rows vs its LoRA-disabled run")
    check_dense(backend, m, info, case, guard, m.x.shape[0])


def init_family(backend, family, batch, req_slack, tok_slack):
    """Initialise ``family`` with room for ``batch`` plus slack; returns the token capacity."""
    if family == "decode":
        tpr = batch.tokens_per_request if batch.bs else 1
        max_bs = max(1, batch.bs + req_slack)
        backend.init_graph("decode", GraphCapacity.decode(max_bs, tpr))
        return max_bs * tpr
    cap = max(1, batch.num_tokens + tok_slack)
    backend.init_graph("prefill", GraphCapacity.prefill(cap, max(1, batch.bs + req_slack)))
    return cap


def family_kinds(family):
    return ("decode", "idle") if family == "decode" else ("extend", "mixed", "decode", "idle")


@pytest.mark.parametrize("family", ["prefill", "decode"])
@given(data=st.data())
def test_graph_family_equals_oracle_and_pad_rows_add_nothing(family, data, guard, layer):
    case = data.draw(moe_lora_cases(CAPS, kinds=family_kinds(family)), label="case")
    m, batch = case.materialize(), case.batch
    backend = make_backend(m.spec)
    cap = init_family(backend, family, batch, data.draw(st.integers(0, 4), label="request slack"),
                      data.draw(st.integers(0, 16), label="token slack"))
    info = backend.prepare(batch, family)
    assert not isinstance(info, Fallback), info
    assert info.use_cuda_graph and info.has_active_lora and info.num_tokens == cap
    assert_exact(info.token_lora_mapping,
                 torch.tensor([*batch.token_lora_mapping, *[-1] * (cap - batch.num_tokens)], dtype=torch.int32),
                 what="token_lora_mapping", seed=case.seed)
    x, ids, w = padded_inputs(m, cap, case.seed)
    with guard():
        y = layer(backend, m, info, x, ids, w)
        y_fused = backend.moe_forward(x, ids, w, m.base, m.lora, info)
    T = batch.num_tokens
    close(y[:T], oracle(m), case, f"{family} graph harness")
    close(y_fused[:T], oracle(m), case, f"{family} graph moe_forward")
    base = layer(backend, m, info, x, ids, w, lora=False)
    rows = info.token_lora_mapping == -1  # base tokens and every pad row
    assert_bit_identical(y[rows], base[rows], "base and pad rows vs LoRA disabled")
    check_dense(backend, m, info, case, guard, cap)


@pytest.mark.parametrize("family", ["prefill", "decode"])
@given(data=st.data())
def test_small_batch_after_a_larger_one_equals_a_fresh_eager_run(family, data, layer):
    kinds = tuple(k for k in family_kinds(family) if k != "idle")
    case = data.draw(moe_lora_cases(CAPS, kinds=kinds), label="case")
    m, big = case.materialize(), case.batch
    n = data.draw(st.integers(0, big.bs - 1), label="requests kept in the small batch")
    small = BatchSpec(big.forward_mode if n else ForwardMode.IDLE, big.requests[:n], big.max_loras,
                      big.lora_ranks, big.scalings)
    backend = make_backend(m.spec)
    cap = init_family(backend, family, big, 0, 0)
    x, ids, w = padded_inputs(m, cap, case.seed)
    info_big = backend.prepare(big, family)
    layer(backend, m, info_big, x, ids, w)
    # the small batch in the whole family, or in the smallest bucket that holds it: views of the same
    # buffers the big batch wrote (DESIGN.md §6)
    in_bucket = data.draw(st.booleans(), label="in a smaller bucket") and n > 0
    bucket = None
    if in_bucket:
        bucket = (GraphCapacity.decode(n, big.tokens_per_request) if family == "decode"
                  else GraphCapacity.prefill(small.num_tokens, n))
    info = backend.prepare(small, family, bucket)
    for name, t in info.device_tensors().items():
        assert t.data_ptr() == info_big.device_tensors()[name].data_ptr(), f"{name} moved"
    Ts, bs = small.num_tokens, small.bs
    buf = info.device_tensors()  # the views the replay reads
    assert info.num_tokens == (bucket.max_tokens if in_bucket else cap)
    for name, tail in (("token_lora_mapping", -1), ("weight_indices", -1), ("req_weight_indices", -1)):
        start = Ts if name == "token_lora_mapping" else bs
        assert bool((buf[name][start:] == tail).all()), f"{name} tail not reset: {buf[name].tolist()}"
    for name in ("seg_indptr", "req_seg_indptr"):
        assert bool((buf[name][bs:] == Ts).all()), f"{name} tail != last live offset {Ts}: {buf[name].tolist()}"
    rows = info.num_tokens
    x, ids, w = x[:rows], ids[:rows], w[:rows]
    y = layer(backend, m, info, x, ids, w)  # rows >= Ts still hold the big batch's activations
    eager = make_backend(m.spec)
    y_eager = layer(eager, m, eager.prepare(small), m.x[:Ts], m.topk_ids[:Ts], m.topk_weights[:Ts])
    expected = oracle(m, m.token_lora_mapping[:Ts], rows=Ts)
    close(y[:Ts], expected, case, "small batch replayed after a large one")
    close(y_eager, expected, case, "fresh eager run of the small batch")
    base = layer(backend, m, info, x, ids, w, lora=False)
    assert_bit_identical(y[Ts:], base[Ts:], "rows past the small batch (stale activations)")


@given(data=st.data())
def test_fallback_over_capacity_writes_nothing_and_eager_is_right(data, layer):
    case = data.draw(moe_lora_cases(CAPS, kinds=("extend", "mixed", "decode")), label="case")
    m, batch = case.materialize(), case.batch
    backend = make_backend(m.spec)
    first = BatchSpec(batch.forward_mode, batch.requests[:1], batch.max_loras, batch.lora_ranks, batch.scalings)
    if batch.forward_mode is ForwardMode.DECODE:
        family = "decode"
        tpr = batch.tokens_per_request
        over = data.draw(st.sampled_from(["requests", "tokens_per_request"]), label="what overflows")
        if over == "requests" and batch.bs > 1:
            backend.init_graph("decode", GraphCapacity.decode(batch.bs - 1, tpr))
        else:
            backend.init_graph("decode", GraphCapacity.decode(batch.bs, tpr + 1))
            first = BatchSpec(ForwardMode.DECODE, [Request(batch.requests[0].slot, tpr + 1)], batch.max_loras,
                              batch.lora_ranks, batch.scalings)
    else:
        family = "prefill"
        over = data.draw(st.sampled_from(["requests", "tokens", "extend_in_decode"]), label="what overflows")
        if over == "extend_in_decode":
            family = "decode"
            backend.init_graph("decode", GraphCapacity.decode(batch.bs, 1))
            first = BatchSpec(ForwardMode.DECODE, [Request(batch.requests[0].slot, 1)], batch.max_loras,
                              batch.lora_ranks, batch.scalings)
        elif over == "requests" and batch.bs > 1:
            backend.init_graph("prefill", GraphCapacity.prefill(batch.num_tokens, batch.bs - 1))
        else:
            backend.init_graph("prefill", GraphCapacity.prefill(max(first.num_tokens, batch.num_tokens - 1), batch.bs))
    if family == "prefill" and batch.num_tokens == first.num_tokens and batch.bs == first.bs:
        return  # a one-request batch that fits: nothing can overflow (covered by other draws)
    assert not isinstance(backend.prepare(first, family), Fallback)
    before = {name: t.clone() for name, t in backend.static_buffers(family).items()}
    result = backend.prepare(batch, family)
    assert isinstance(result, Fallback) and result.reason, result
    for name, t in backend.static_buffers(family).items():
        assert_exact(t, before[name], what=f"{family}.{name} after Fallback ({result.reason})", seed=case.seed)
    info = backend.prepare(batch)
    close(layer(backend, m, info, m.x, m.topk_ids, m.topk_weights), oracle(m), case, "eager after Fallback")


def small_spec(**kw):
    return LoRALayerSpec(hidden_size=8, moe_intermediate_size=4, num_experts=3, top_k=2, dense_shapes={"q": (8, 6)},
                         max_loras=2, max_rank=4, **kw)


def test_static_buffers_keep_addresses_and_families_share_no_storage():
    backend = make_backend(small_spec())
    backend.init_graph("decode", GraphCapacity.decode(4, 2))
    backend.init_graph("prefill", GraphCapacity.prefill(32, 5))
    backend.init_graph("prefill", GraphCapacity.prefill(32, 5))  # same capacities: a no-op
    ptrs = {f: {n: t.data_ptr() for n, t in backend.static_buffers(f).items()} for f in ("decode", "prefill")}
    batches = [
        BatchSpec(ForwardMode.DECODE, [Request(0, 2), Request(-1, 2), Request(1, 2)], 2, (4, 2), (1.0, 2.0)),
        BatchSpec(ForwardMode.EXTEND, [Request(1, 7), Request(0, 20)], 2, (4, 2), (1.0, 2.0)),
        BatchSpec(ForwardMode.IDLE, [], 2, (4, 2), (1.0, 2.0)),
    ]
    for batch in batches:
        for family in ("decode", "prefill"):
            info = backend.prepare(batch, family)
            if isinstance(info, Fallback):
                continue
            for name, t in info.device_tensors().items():
                assert t.data_ptr() in ptrs[family].values(), f"{family} info.{name} is not a static buffer"
        backend.prepare(batch)  # eager batches allocate fresh tensors, never the static ones
    for family in ("decode", "prefill"):
        assert {n: t.data_ptr() for n, t in backend.static_buffers(family).items()} == ptrs[family]
    spans = {f: [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                 for t in backend.static_buffers(f).values()] for f in ("decode", "prefill")}
    for a0, a1 in spans["decode"]:
        for b0, b1 in spans["prefill"]:
            assert a1 <= b0 or b1 <= a0, "decode and prefill static buffers share storage"


def test_inactive_eager_batch_leaves_poisoned_outputs_untouched():
    spec = small_spec(dtype=F16)
    backend = make_backend(spec)
    lora = LoRAWeights(spec)
    lora.load_slot(0, {"gate": ModuleLoRA(torch.randn(3, 2, 8), torch.randn(3, 4, 2), 1.0),
                       "down": ModuleLoRA(torch.randn(3, 2, 4), torch.randn(3, 8, 2), 1.0),
                       "q": ModuleLoRA(torch.randn(2, 8), torch.randn(6, 2), 1.0)})
    active = backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(0, 3)], 2, (2, 0), (1.0, 0.0)))
    info = backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(-1, 3)], 2, (2, 0), (1.0, 0.0)))
    assert active.has_active_lora and not info.has_active_lora
    x, ids = torch.randn(3, 8, dtype=F16), torch.tensor([[0, 1], [2, 0], [1, 2]], dtype=torch.int32)
    gate_up = torch.full((3, 2, 8), float("nan"), dtype=F16)
    down = torch.full((3, 2, 8), float("nan"), dtype=F16)
    dense = torch.full((3, 6), float("nan"), dtype=F16)
    h, w = torch.randn(6, 4, dtype=F16), torch.rand(3, 2)
    snapshot = [t.clone() for t in (gate_up, down, dense)]
    backend.moe_gate_up_delta(x, ids, gate_up, lora, info)
    backend.moe_down_delta(h, ids, w, down, lora, info)
    backend.dense_delta("q", x, dense, lora, info)
    for got, want, name in zip((gate_up, down, dense), snapshot, ("gate_up_out", "down_out", "out")):
        assert_bit_identical(got, want, f"{name} of an inactive batch")
    control = torch.zeros(3, 2, 8, dtype=F16)  # an active batch does write
    backend.moe_gate_up_delta(x, ids, control, lora, active)
    assert bool((control[:, :, :4] != 0).any())


def test_guard_catches_a_host_sync(guard):  # the guard used above can fail
    with pytest.raises(HostSyncError), guard():
        torch.ones(2).sum().item()


@pytest.mark.parametrize("call, field", [
    (lambda b, i: b.prepare(BatchSpec(ForwardMode.IDLE, [], 3, (0, 0, 0), (0, 0, 0))), "batch.max_loras"),
    (lambda b, i: b.prepare(BatchSpec(ForwardMode.EXTEND, [Request(0, 1)], 2, (5, 0), (1, 0))),
     r"batch.lora_ranks\[0\]"),
    (lambda b, i: b.prepare(BatchSpec(ForwardMode.IDLE, [], 2, (0, 0), (0, 0)), "verify"), "family"),
    (lambda b, i: b.prepare(BatchSpec(ForwardMode.IDLE, [], 2, (0, 0), (0, 0)), "decode"), "not initialised"),
    (lambda b, i: (b.init_graph("prefill", GraphCapacity.prefill(8, 2)),
                   b.init_graph("prefill", GraphCapacity.prefill(16, 2))), "prefill"),
    (lambda b, i: b.init_graph("decode", GraphCapacity.decode(0)), "max_bs"),
    (lambda b, i: b.init_graph("decode", GraphCapacity.prefill(8, 2)), "capacity: the decode family takes"),
    (lambda b, i: (b.init_graph("prefill", GraphCapacity.prefill(8, 2)),
                   b.prepare(BatchSpec(ForwardMode.IDLE, [], 2, (0, 0), (0, 0)), "prefill",
                             GraphCapacity.prefill(16, 2))), "bucket: .* not within"),
    (lambda b, i: b.prepare(BatchSpec(ForwardMode.IDLE, [], 2, (0, 0), (0, 0)), None, GraphCapacity.prefill(8, 2)),
     "bucket: an eager prepare"),
    (lambda b, i: b.dense_delta("v", torch.zeros(2, 8), torch.zeros(2, 6), i[1], i[0]), "module"),
    (lambda b, i: b.dense_delta("q", torch.zeros(3, 8), torch.zeros(3, 6), i[1], i[0]), "x"),
    (lambda b, i: b.moe_gate_up_delta(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32),
                                      torch.zeros(2, 2, 8), i[1], i[0]), "topk_ids"),
    (lambda b, i: b.moe_gate_up_delta(torch.zeros(2, 8), torch.zeros(2, 2, dtype=torch.int32),
                                      torch.zeros(2, 2, 4), i[1], i[0]), "gate_up_out"),
    (lambda b, i: b.moe_down_delta(torch.zeros(4, 4), torch.zeros(2, 2), torch.zeros(2, 2),
                                   torch.zeros(2, 2, 8), i[1], i[0]), "topk_ids"),
    # non-floating activations, router weights and outputs (a regression: int32 was
    # accepted and the delta truncated)
    (lambda b, i: b.moe_gate_up_delta(torch.ones(2, 8, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                      torch.zeros(2, 2, 8), i[1], i[0]), "x: .*floating"),
    (lambda b, i: b.moe_gate_up_delta(torch.ones(2, 8), torch.zeros(2, 2, dtype=torch.int32),
                                      torch.zeros(2, 2, 8, dtype=torch.int32), i[1], i[0]), "gate_up_out: .*floating"),
    (lambda b, i: b.moe_down_delta(torch.ones(4, 4, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int32),
                                   torch.ones(2, 2), torch.zeros(2, 2, 8), i[1], i[0]), "h: .*floating"),
    (lambda b, i: b.moe_down_delta(torch.ones(4, 4), torch.zeros(2, 2, dtype=torch.int32),
                                   torch.ones(2, 2, dtype=torch.int32), torch.zeros(2, 2, 8), i[1], i[0]),
     "topk_weights: .*floating"),
    (lambda b, i: b.moe_down_delta(torch.ones(4, 4), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2),
                                   torch.zeros(2, 2, 8, dtype=torch.bool), i[1], i[0]), "down_out: .*floating"),
    (lambda b, i: b.dense_delta("q", torch.ones(2, 8, dtype=torch.int32), torch.zeros(2, 6), i[1], i[0]),
     "x: .*floating"),
    (lambda b, i: b.dense_delta("q", torch.ones(2, 8), torch.zeros(2, 6, dtype=torch.int32), i[1], i[0]),
     "out: .*floating"),
])
def test_bad_calls_raise_clear_errors(call, field):
    backend = make_backend(small_spec())
    info = backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(0, 2)], 2, (2, 0), (1.0, 0.0)))
    with pytest.raises(InvalidFieldError, match=field):
        call(backend, (info, LoRAWeights(small_spec())))


def test_the_previous_protocol_names_its_replacement():
    backend = make_backend(small_spec())
    with pytest.raises(RenamedError, match=r"init_graph\('decode', GraphCapacity.decode\(max_bs, tokens_per_request\)\)"):
        backend.init_decode_graph(4, 1)
    with pytest.raises(RenamedError, match=r"init_graph\('prefill', GraphCapacity.prefill"):
        backend.init_prefill_graph(16, 4)

    class OldStyle:  # a third-party backend written for the previous protocol
        def capabilities(self):
            return backend.capabilities()

        def init_decode_graph(self, max_bs, tokens_per_request=1): ...

        def prepare(self, batch, family=None): ...

    with pytest.raises(RenamedError, match=r"OldStyle.init_decode_graph.*implement init_graph\(family, capacity\)"):
        check_protocol(OldStyle())
    OldStyle.init_graph = lambda self, family, capacity: None
    with pytest.raises(RenamedError, match=r"prepare\(batch, family=None, bucket=None\)"):
        check_protocol(OldStyle())
    check_protocol(backend)


def test_weights_of_another_pool_are_refused():
    backend = make_backend(small_spec())
    info = backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(0, 2)], 2, (2, 0), (1.0, 0.0)))
    other = LoRAWeights(LoRALayerSpec(hidden_size=8, moe_intermediate_size=4, num_experts=3, top_k=2,
                                      dense_shapes={"q": (8, 6)}, max_loras=2, max_rank=8))
    with pytest.raises(InvalidFieldError, match="weights"):
        backend.dense_delta("q", torch.zeros(2, 8), torch.zeros(2, 6), other, info)
