"""Dense LoRA kernels (segmented LoRA-A/B, chunked SGMV shrink/expand) against their twins and the oracle.

Covers: drawn batches and adapter pools (mixed and per-module ranks, rank-0 modules, base
requests) under every segmentation of ``moelora_reference.segments`` (per request; decode sorted
by adapter with a permutation; 16-token prefill-graph tiles; csgmv chunks of 3–64 tokens), eagerly
and with graph capacity tails (empty tail segments, weight index -1, padding rows, max_len a
capacity): output equal to the twin within tolerance, rows of tokens without LoRA bit-identical,
the intermediate NaN where nothing is written; fp32 deltas against the fp64 oracle; named cases:
mixed ranks with a host max_rank, a single token, launcher precondition errors, a max_rank below a
loaded slot's rank refused by ``dense_lora_delta``.
"""

import dataclasses

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close, cpu, launch_guard, poisoned, randn
from moe_lora_testing import cpu_weights

from moelora_conformance.strategies import moe_lora_cases
from moelora_core import (
    NO_ADAPTER,
    BatchSpec,
    ForwardMode,
    KernelPreconditionError,
    LoRALayerSpec,
    LoRAWeights,
    ModuleLoRA,
    Request,
)
from moelora_kernels import (
    chunked_sgmv_expand,
    chunked_sgmv_shrink,
    dense_lora_delta,
    segmented_lora_a,
    segmented_lora_b,
)
from moelora_reference import segments as seg
from moelora_reference import sgmv as twin
from moelora_reference.backend import ReferenceBackend
from moelora_reference.oracle import dense_lora_forward

pytestmark = pytest.mark.interpreter

SEGMENTATIONS = ("request", "decode_adapter", "tile", "csgmv")


def segments_of(batch, kind, chunk):
    lens, slots = batch.seq_lens, batch.req_weight_indices
    if kind == "request":
        return seg.request_segments(lens, slots)
    if kind == "decode_adapter":
        return seg.decode_adapter_segments(lens, slots)
    if kind == "tile":
        return seg.tile_segments(lens, slots)
    return seg.csgmv_segments(batch.token_lora_mapping, chunk)


def with_capacity(s, token_tail, segment_tail):
    """Static-buffer form: tail segments empty at the last live offset with slot -1, the permutation
    extended onto padding rows (whose tokens have no adapter)."""
    n = s.num_tokens
    indptr = torch.tensor(list(s.seg_indptr) + [n] * segment_tail, dtype=torch.int32)
    weights = torch.tensor(list(s.weight_indices) + [NO_ADAPTER] * segment_tail, dtype=torch.int32)
    perm = None
    if s.permutation is not None:
        perm = torch.tensor(list(s.permutation) + list(range(n, n + token_tail)), dtype=torch.int64)
    return indptr.to(DEVICE), weights.to(DEVICE), None if perm is None else perm.to(DEVICE)


def run_pair(kind, x, A, B, ranks, scalings, indptr, weights, perm, out, max_len, max_rank=None):
    chunked = kind == "csgmv"
    R = A.shape[1]
    inter = poisoned(x.shape[0], R, dtype=x.dtype)
    with launch_guard():
        if chunked:
            chunked_sgmv_shrink(x, A, indptr, weights, ranks, perm, max_len=max_len, out=inter, max_rank=max_rank)
            chunked_sgmv_expand(inter, B, indptr, weights, ranks, scalings, perm, out, max_len=max_len,
                                max_rank=max_rank)
        else:
            segmented_lora_a(x, A, indptr, weights, ranks, max_len=max_len, permutation=perm, out=inter,
                             max_rank=max_rank)
            segmented_lora_b(inter, B, indptr, weights, ranks, scalings, out, max_len=max_len, permutation=perm,
                             max_rank=max_rank)
    return inter


def twin_pair(kind, x, A, B, ranks, scalings, indptr, weights, perm, out0, max_len, max_rank=None):
    args = (indptr, weights, ranks)
    if kind == "csgmv":
        t = twin.chunked_sgmv_shrink(x, A, *args, perm, max_len=max_len, max_rank=max_rank)
        out = twin.chunked_sgmv_expand(t, B, *args, scalings, perm, out0.clone(), max_len=max_len, max_rank=max_rank)
    else:
        t = twin.segmented_lora_a(x, A, *args, max_len=max_len, permutation=perm, max_rank=max_rank)
        out = twin.segmented_lora_b(t, B, *args, scalings, out0.clone(), max_len=max_len, permutation=perm,
                                    max_rank=max_rank)
    return t.cpu(), out


@st.composite
def dense_problems(draw):
    case = draw(moe_lora_cases(kinds=("extend", "decode", "mixed")), label="case")
    assume(case.shape.dense_shapes)
    module = draw(st.sampled_from([m for m, _ in case.shape.dense_shapes]), label="module")
    kind = draw(st.sampled_from(SEGMENTATIONS), label="segmentation")
    chunk = draw(st.sampled_from((3, 16, 32, 64)), label="chunk size")
    graph = draw(st.booleans(), label="graph capacity")
    token_tail = draw(st.integers(0, 8), label="token tail") if graph else 0
    segment_tail = draw(st.integers(0, 6), label="segment tail") if graph else 0
    return case, module, kind, chunk, graph, token_tail, segment_tail


@given(problem=dense_problems())
def test_dense_lora_matches_twin(problem):
    case, module, kind, chunk, graph, token_tail, segment_tail = problem
    c = case.materialize(DEVICE)
    w = c.lora
    A, B = w.factors(module)
    ranks, scalings = w.ranks(module), w.scalings(module)
    gen = torch.Generator().manual_seed(case.seed)
    s = segments_of(case.batch, kind, chunk)
    T = s.num_tokens + token_tail
    x = torch.cat([c.dense_x[module], randn(gen, token_tail, A.shape[2], dtype=c.x.dtype)])
    out0 = randn(gen, T, B.shape[1], dtype=c.x.dtype, scale=0.1)
    indptr, weights, perm = with_capacity(s, token_tail, segment_tail)
    max_len = T if graph else s.max_len
    out = out0.clone()
    inter = run_pair(kind, x, A, B, ranks, scalings, indptr, weights, perm, out, max_len)
    want_t, want = twin_pair(kind, x, A, B, ranks, scalings, indptr, weights, perm, out0, max_len)
    what = f"{module} {kind} graph={graph}"
    written = ~want_t.isnan().any(dim=1)
    assert_close(inter.cpu()[written], want_t[written], dtype=c.x.dtype, what=f"{what} intermediate", seed=case.seed)
    assert bool(inter.cpu()[~written].isnan().all()), f"{what}: intermediate rows written outside segments"
    assert_close(out, want, dtype=c.x.dtype, what=what, seed=case.seed)
    mapping = torch.tensor(list(case.batch.token_lora_mapping) + [NO_ADAPTER] * token_tail)
    module_rank = cpu(ranks)[mapping.clamp(min=0)]
    no_lora = (mapping == NO_ADAPTER) | (module_rank == 0)
    assert_bitwise_equal(out.cpu()[no_lora], out0.cpu()[no_lora], what=f"{what}: rows without LoRA", seed=case.seed)
    if c.x.dtype == torch.float32 and not token_tail and T <= 512:
        oracle = dense_lora_forward(cpu(x), None, module, cpu_weights(w), mapping)
        assert_close(out.cpu().double() - out0.cpu().double(), oracle, dtype=torch.float32, what=f"{what} vs oracle",
                     seed=case.seed)


def _pool(seed, ranks, R=16, dtype=torch.float32, fin=40, fout=24):
    gen = torch.Generator().manual_seed(seed)
    spec = LoRALayerSpec(hidden_size=8, moe_intermediate_size=8, num_experts=2, top_k=1,
                         dense_shapes={"q": (fin, fout)}, max_loras=len(ranks), max_rank=R, dtype=dtype,
                         device=DEVICE)
    w = LoRAWeights(spec)
    for slot, r in enumerate(ranks):
        if r:
            w.load_slot(slot, {"q": ModuleLoRA(torch.randn(r, fin, generator=gen) / fin**0.5,
                                               torch.randn(fout, r, generator=gen) / r**0.5, 0.5 + slot)})
    return w, gen


@pytest.mark.parametrize("kind", SEGMENTATIONS)
@pytest.mark.parametrize("max_rank", [None, 13])
def test_mixed_ranks_with_a_host_rank_bound(kind, max_rank):
    # slots of rank 13, 1, 0 (empty) and 7 in one batch (R = 16); max_rank 13 bounds every slot's rank loop
    w, gen = _pool(40, [13, 1, 0, 7])
    lens, slots = (5, 1, 9, 3, 40, 2), (0, 1, 2, 3, -1, 0)
    batch = BatchSpec(ForwardMode.EXTEND, [Request(s, n) for s, n in zip(slots, lens)], 4, (13, 1, 0, 7),
                      (0.5, 1.5, 0.0, 3.5))
    s = segments_of(batch, kind, 4)
    A, B = w.factors("q")
    x = randn(gen, s.num_tokens, 40, dtype=torch.float32)
    out0 = randn(gen, s.num_tokens, 24, dtype=torch.float32, scale=0.1)
    indptr, weights, perm = with_capacity(s, 0, 0)
    out = out0.clone()
    run_pair(kind, x, A, B, w.ranks("q"), w.scalings("q"), indptr, weights, perm, out, s.max_len, max_rank)
    _, want = twin_pair(kind, x, A, B, w.ranks("q"), w.scalings("q"), indptr, weights, perm, out0, s.max_len,
                        max_rank)
    assert_close(out, want, dtype=torch.float32, what=f"mixed ranks {kind}", seed=40)
    oracle = dense_lora_forward(cpu(x), None, "q", cpu_weights(w), torch.tensor(batch.token_lora_mapping))
    assert_close(out.cpu().double() - out0.cpu().double(), oracle, dtype=torch.float32, what="vs oracle", seed=40)


@pytest.mark.parametrize("kind", SEGMENTATIONS)
def test_single_token(kind):
    w, gen = _pool(41, [4], dtype=torch.float16)
    batch = BatchSpec(ForwardMode.DECODE, [Request(0, 1, 7)], 1, (4,), (2.0,))
    s = segments_of(batch, kind, 16)
    A, B = w.factors("q")
    x, out0 = randn(gen, 1, 40, dtype=torch.float16), randn(gen, 1, 24, dtype=torch.float16, scale=0.1)
    indptr, weights, perm = with_capacity(s, 0, 0)
    out = out0.clone()
    run_pair(kind, x, A, B, w.ranks("q"), w.scalings("q"), indptr, weights, perm, out, 1)
    _, want = twin_pair(kind, x, A, B, w.ranks("q"), w.scalings("q"), indptr, weights, perm, out0, 1)
    assert_close(out, want, dtype=torch.float16, what=f"single token {kind}", seed=41)


def _call(name, **override):
    w, _ = _pool(42, [4, 2])
    A, B = w.factors("q")
    args = {"x": torch.randn(6, 40, device=DEVICE), "inter": torch.zeros(6, 16, device=DEVICE),
            "out": torch.zeros(6, 24, device=DEVICE), "indptr": torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE),
            "weights": torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            "perm": torch.arange(6, device=DEVICE), "A": A, "B": B, "ranks": w.ranks("q"), "scalings": w.scalings("q"),
            "max_len": 4, "max_rank": None}
    args.update(override)
    a = args
    if name == "segmented_lora_a":
        segmented_lora_a(a["x"], a["A"], a["indptr"], a["weights"], a["ranks"], max_len=a["max_len"],
                         max_rank=a["max_rank"])
    elif name == "segmented_lora_b":
        segmented_lora_b(a["inter"], a["B"], a["indptr"], a["weights"], a["ranks"], a["scalings"], a["out"],
                         max_len=a["max_len"])
    elif name == "chunked_sgmv_shrink":
        chunked_sgmv_shrink(a["x"], a["A"], a["indptr"], a["weights"], a["ranks"], a["perm"], max_len=a["max_len"])
    else:
        chunked_sgmv_expand(a["inter"], a["B"], a["indptr"], a["weights"], a["ranks"], a["scalings"], a["perm"],
                            a["out"], max_len=a["max_len"])


@pytest.mark.parametrize("name, override, match", [
    ("segmented_lora_a", {"x": torch.randn(6, 41)}, "input width"),
    ("segmented_lora_a", {"x": torch.randn(6, 40).half()}, "lora_a: dtype"),
    ("segmented_lora_a", {"indptr": torch.tensor([0, 6])}, "seg_indptr"),
    ("segmented_lora_a", {"weights": torch.tensor([0, 1])}, "weight_indices: dtype"),
    ("segmented_lora_a", {"max_rank": 17}, "max_rank"),
    ("segmented_lora_a", {"max_len": -1}, "max_len"),
    ("segmented_lora_b", {"out": torch.zeros(6, 23)}, "out: expected shape"),
    ("segmented_lora_b", {"scalings": torch.zeros(2, dtype=torch.float16)}, "scalings: dtype"),
    ("chunked_sgmv_shrink", {"perm": None}, "permutation"),
    ("chunked_sgmv_shrink", {"perm": torch.arange(6, dtype=torch.int32)}, "permutation: dtype"),
    ("chunked_sgmv_expand", {"inter": torch.zeros(6, 8)}, "intermediate: expected shape"),
])
def test_launcher_refuses_bad_arguments(name, override, match):
    override = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in override.items()}
    with pytest.raises(KernelPreconditionError, match=match):
        _call(name, **override)


@pytest.mark.parametrize("chunked", [False, True], ids=["segmented", "chunked"])
def test_dense_lora_delta_refuses_max_rank_below_a_loaded_slots_rank(chunked):
    # Regression: dense_lora_delta has the pool, so a max_rank below a
    # loaded slot's rank of the module (which would cut that slot's rank loop) is refused on the host.
    w, gen = _pool(43, [4, 2])
    batch = BatchSpec(ForwardMode.EXTEND, [Request(0, 3), Request(1, 2)], 2, (4, 2), (1.0, 2.0))
    info = ReferenceBackend(w.spec).prepare(batch)
    if chunked:
        info = dataclasses.replace(info, permutation=torch.arange(5, device=DEVICE))
    x, out = randn(gen, 5, 40, dtype=torch.float32), randn(gen, 5, 24, dtype=torch.float32)
    before = out.clone()
    with pytest.raises(KernelPreconditionError, match="max_rank: 3 < rank 4 of slot 0"):
        dense_lora_delta("q", x, out, w, info, chunked=chunked, max_rank=3)
    assert_bitwise_equal(out, before, what="nothing written before the refusal")
    dense_lora_delta("q", x, out, w, info, chunked=chunked, max_rank=4)
    assert not torch.equal(out.cpu(), before.cpu())
