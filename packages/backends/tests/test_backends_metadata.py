"""``prepare`` of the ``triton`` and ``csgmv`` backends: metadata exactly as the batch's host lists say,
eagerly and in the graph families' static buffers.

Covers, for both backends: the capabilities (every one declared; the CPU only under the Triton
interpreter); on drawn batches, eagerly: request segments, token mapping (the mapping kernel),
enabled slots and the segmentation equal to the twins of ``moelora_reference.segments``, host
numbers the batch's; in a graph family after a larger batch: the same values with every tail reset
(offsets to the last live offset, slots and mappings -1, permutation tail = the pad rows), host
numbers the capacities, addresses unchanged; the same in the smallest bucket that holds the batch
(views of the family's buffers, tails reset up to the bucket's lengths, host numbers within the
family's); the decode and prefill families share no
storage; a batch over capacity returns ``Fallback`` and writes nothing; an eager IDLE batch launches
no kernel; refusals (uninitialised or re-initialised family, unknown family, slot count, rank > R).
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_backends.csgmv_backend import CsgmvBackend
from moelora_backends.segmentation import MAX_CHUNK, PREFILL_TILE, chunk_size_for
from moelora_backends.triton_backend import TritonBackend
from moelora_conformance.strategies import batch_specs
from moelora_core import (
    BatchSpec,
    Fallback,
    ForwardMode,
    InvalidFieldError,
    LoRALayerSpec,
    Request,
    assert_exact,
    load_backend,
)
from moelora_core.backend_checks import GraphCapacity
from moelora_core.graphs.triton_launches import intercept_triton_launches
from moelora_reference import segments as twin

pytestmark = pytest.mark.interpreter
BACKENDS = {"triton": TritonBackend, "csgmv": CsgmvBackend}
L = 3


def _spec(**kw):
    args = dict(hidden_size=8, moe_intermediate_size=8, num_experts=4, top_k=2, dense_shapes={"q": (8, 8)},
                max_loras=L, max_rank=4)
    args.update(kw)
    return LoRALayerSpec(**args)


def _expected_segments(name, batch, family, capacity_tokens=None):
    lens, slots = list(batch.seq_lens), list(batch.req_weight_indices)
    if name == "csgmv":
        size = chunk_size_for(batch.num_tokens if family is None else capacity_tokens)
        return twin.csgmv_segments(list(batch.token_lora_mapping), size)
    if family == "prefill":
        return twin.tile_segments(lens, slots, PREFILL_TILE, merge=True)
    if family == "decode" or batch.forward_mode is ForwardMode.DECODE:
        return twin.decode_adapter_segments(lens, slots)
    return twin.request_segments(lens, slots)


def _check(name, info, batch, *, family=None, cap_requests=None, cap_tokens=None, cap_segments=None,
           chunk_tokens=None):
    """Every device field against the host lists; tails past the live entries reset (``chunk_tokens``:
    the family's token capacity, which sets csgmv's chunk size; default ``cap_tokens``)."""
    T, bs = batch.num_tokens, batch.bs
    graph = family is not None
    R = cap_requests if graph else bs
    N = cap_tokens if graph else T
    seg = _expected_segments(name, batch, family, chunk_tokens or cap_tokens)
    S = cap_segments if graph else seg.num_segments
    ex = lambda t, want, what, dtype=torch.int32: assert_exact(t, torch.tensor(want, dtype=dtype), what=what)
    offsets = list(batch.req_seg_indptr) + [T] * (R - bs)
    slots = list(batch.req_weight_indices) + [-1] * (R - bs)
    ex(info.req_seg_indptr, offsets, "req_seg_indptr")
    ex(info.req_weight_indices, slots, "req_weight_indices")
    ex(info.token_lora_mapping, list(batch.token_lora_mapping) + [-1] * (N - T), "token_lora_mapping")
    ex(info.adapter_enabled, list(batch.adapter_enabled), "adapter_enabled")
    live = seg.num_segments
    ex(info.seg_indptr, list(seg.seg_indptr) + [T] * (S - live), "seg_indptr")
    ex(info.weight_indices, list(seg.weight_indices) + [-1] * (S - live), "weight_indices")
    if seg.permutation is None:
        assert info.permutation is None
    else:
        ex(info.permutation, list(seg.permutation) + list(range(T, N)), "permutation", torch.int64)
    assert (info.req_weight_indices.numel(), info.num_tokens, info.num_segments) == (R, N, S)
    assert info.use_cuda_graph is graph
    assert info.has_active_lora is (True if graph else batch.has_active_lora)
    if not graph:
        assert info.max_len == seg.max_len


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_capabilities_declare_everything_implemented(name):
    backend = load_backend(name)(_spec())
    caps = backend.capabilities()
    assert caps.dtypes == {torch.float32, torch.float16, torch.bfloat16}
    assert caps.graph_families == {"decode", "prefill"} and caps.prefill_graph_modes == {"full", "breakable"}
    assert caps.virtual_experts and caps.max_requests is None and caps.max_rank is None and not caps.fused_moe
    assert "cpu" in caps.devices  # TRITON_INTERPRET=1 in this session: the kernels run on the CPU


@st.composite
def _pool_batches(draw, kinds):
    ranks = tuple(draw(st.integers(0, 4), label=f"rank {s}") for s in range(L))
    scalings = tuple(draw(st.sampled_from((0.5, 2.0)), label=f"σ {s}") for s in range(L))
    return draw(batch_specs(L, ranks, scalings, kinds=kinds), label="batch")


@pytest.mark.parametrize("name", sorted(BACKENDS))
@given(batch=_pool_batches(("extend", "decode", "mixed", "idle")))
def test_eager_metadata_equals_the_host_lists(name, batch):
    info = BACKENDS[name](_spec()).prepare(batch)
    _check(name, info, batch)


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("family", ["decode", "prefill"])
@given(data=st.data())
def test_graph_metadata_resets_tails_after_a_larger_batch(name, family, data):
    kinds = ("decode",) if family == "decode" else ("extend", "mixed")
    small = data.draw(_pool_batches(kinds), label="small batch")
    if small.forward_mode is ForwardMode.IDLE:
        return
    tpr = small.tokens_per_request if family == "decode" else 1
    extra = data.draw(st.integers(1, 6), label="extra requests")
    slots = [data.draw(st.integers(-1, L - 1), label="slot") for _ in range(extra)]
    lens = [tpr] * extra if family == "decode" else [data.draw(st.integers(1, 20), label="len") for _ in slots]
    # The small batch's requests and more: larger in requests and tokens, other segments.
    large = BatchSpec(small.forward_mode, [*small.requests, *(Request(s, n) for s, n in zip(slots, lens))], L,
                      small.lora_ranks, small.scalings)
    backend = BACKENDS[name](_spec())
    cap_requests = large.bs + data.draw(st.integers(0, 2), label="request slack")
    if family == "decode":
        backend.init_graph("decode", GraphCapacity.decode(cap_requests, tpr))
        cap_tokens = cap_requests * tpr
    else:
        cap_tokens = large.num_tokens + data.draw(st.integers(0, 9), label="token slack")
        backend.init_graph("prefill", GraphCapacity.prefill(cap_tokens, cap_requests))
    first = backend.prepare(large, family)
    cap_segments = first.num_segments
    ptrs = {k: t.data_ptr() for k, t in first.device_tensors().items()}
    idle = BatchSpec(ForwardMode.IDLE, (), L, small.lora_ranks, small.scalings)
    for batch in (small, idle, large):
        info = backend.prepare(batch, family)
        _check(name, info, batch, family=family, cap_requests=cap_requests, cap_tokens=cap_tokens,
               cap_segments=cap_segments)
        assert {k: t.data_ptr() for k, t in info.device_tensors().items()} == ptrs
        assert info.max_len == first.max_len
    # the small batch in the smallest bucket that holds it, after the large batch filled the buffers
    bucket = (GraphCapacity.decode(small.bs, tpr) if family == "decode"
              else GraphCapacity.prefill(small.num_tokens, small.bs))
    info = backend.prepare(small, family, bucket)
    _check(name, info, small, family=family, cap_requests=bucket.max_requests, cap_tokens=bucket.max_tokens,
           cap_segments=info.weight_indices.numel(), chunk_tokens=cap_tokens)
    assert {k: t.data_ptr() for k, t in info.device_tensors().items()} == ptrs
    assert info.num_segments <= cap_segments and info.max_len <= first.max_len


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_families_share_no_storage_and_prefill_capacity_follows_the_tile_bound(name):
    backend = BACKENDS[name](_spec())
    backend.init_graph("decode", GraphCapacity.decode(5, 2))
    backend.init_graph("prefill", GraphCapacity.prefill(40, 7))
    dec = backend.static_buffers("decode")
    pre = backend.static_buffers("prefill")
    spans = lambda bufs: [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in bufs.values()]
    for a, n in spans(dec):
        for b, m in spans(pre):
            assert a + n <= b or b + m <= a
    if name == "triton":
        assert pre["weight_indices"].numel() == 40 // 16 + 7  # grid <= capacity / 16 + requests
        assert dec["weight_indices"].numel() == min(5, L + 1)  # one segment per adapter
        assert "permutation" in dec and "permutation" not in pre
    else:
        size = chunk_size_for(40)
        assert pre["weight_indices"].numel() == 40 // size + min(L + 1, 7)
        assert "permutation" in dec and "permutation" in pre


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("over", ["requests", "tokens", "tokens per request", "extend in decode"])
def test_over_capacity_falls_back_and_writes_nothing(name, over):
    backend = BACKENDS[name](_spec())
    pool = (L, (4, 2, 0), (1.0, 2.0, 0.0))
    backend.init_graph("decode", GraphCapacity.decode(3, 1))
    backend.init_graph("prefill", GraphCapacity.prefill(12, 3))
    fits = {"decode": BatchSpec(ForwardMode.DECODE, [Request(0, 1), Request(1, 1)], *pool),
            "prefill": BatchSpec(ForwardMode.EXTEND, [Request(0, 5), Request(-1, 3)], *pool)}
    too_big = {
        "requests": ("prefill", BatchSpec(ForwardMode.EXTEND, [Request(0, 1)] * 4, *pool)),
        "tokens": ("prefill", BatchSpec(ForwardMode.EXTEND, [Request(1, 13)], *pool)),
        "tokens per request": ("decode", BatchSpec(ForwardMode.DECODE, [Request(0, 2)], *pool)),
        "extend in decode": ("decode", BatchSpec(ForwardMode.EXTEND, [Request(0, 1)], *pool)),
    }[over]
    family, batch = too_big
    backend.prepare(fits[family], family)
    before = {k: t.clone() for k, t in backend.static_buffers(family).items()}
    result = backend.prepare(batch, family)
    assert isinstance(result, Fallback) and result.reason
    for k, t in backend.static_buffers(family).items():
        assert torch.equal(t, before[k]), k


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_an_eager_idle_or_base_batch_launches_nothing(name):
    backend = BACKENDS[name](_spec())
    pool = (L, (4, 0, 0), (1.0, 0.0, 0.0))
    launches = []

    def count(kernel, run, args, kwargs, grid):
        launches.append(kernel)
        return run(kernel, *args, grid=grid, warmup=False, **kwargs)

    with intercept_triton_launches(count):
        info = backend.prepare(BatchSpec(ForwardMode.IDLE, (), *pool))
    assert not launches and info.num_tokens == 0 and not info.has_active_lora
    assert_exact(info.adapter_enabled, torch.zeros(L, dtype=torch.int32), what="IDLE adapter_enabled")
    base = backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(-1, 3), Request(1, 2)], *pool))
    assert not base.has_active_lora  # slot 1 has rank 0: its tokens are base tokens


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_bad_calls_are_refused(name):
    backend = BACKENDS[name](_spec())
    pool = (L, (4, 4, 4), (1.0, 1.0, 1.0))
    batch = BatchSpec(ForwardMode.EXTEND, [Request(0, 2)], *pool)
    with pytest.raises(InvalidFieldError, match="not initialised"):
        backend.prepare(batch, "prefill")
    with pytest.raises(InvalidFieldError, match="family"):
        backend.prepare(batch, "verify")
    with pytest.raises(InvalidFieldError, match="max_loras"):
        backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(0, 2)], 2, (4, 4), (1.0, 1.0)))
    with pytest.raises(InvalidFieldError, match="max_rank"):
        backend.prepare(BatchSpec(ForwardMode.EXTEND, [Request(0, 2)], L, (5, 4, 4), (1.0, 1.0, 1.0)))
    backend.init_graph("prefill", GraphCapacity.prefill(16, 2))
    backend.init_graph("prefill", GraphCapacity.prefill(16, 2))  # the same capacities again: a no-op
    with pytest.raises(InvalidFieldError, match="allocated once"):
        backend.init_graph("prefill", GraphCapacity.prefill(32, 2))
    with pytest.raises(InvalidFieldError, match="max_bs"):
        backend.init_graph("decode", GraphCapacity.decode(0, 1))
    with pytest.raises(InvalidFieldError, match="segments per launch"):  # refused before anything is allocated
        BACKENDS[name](_spec()).init_graph("prefill", GraphCapacity.prefill(MAX_CHUNK * 70000, 1))
